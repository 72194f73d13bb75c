"""Dynamic placement decisions from telemetry, and the cluster simulator."""

from __future__ import annotations

import pytest

from gcore.errors import ConfigError
from gcore.placement.base import Telemetry
from gcore.placement.dynamic import DynamicPlacement


def telemetry(step: int, generate: float, judge: float, ranks: int = 2) -> Telemetry:
    # every rank reports the same roles; the slowest rank's numbers drive the decision
    return Telemetry(step, [{"generate": generate, "reward": judge * (1 - 0.1 * r)} for r in range(ranks)])


def test_moves_device_to_judge_when_its_cost_rises_and_back():
    policy = DynamicPlacement(judge_fraction=0.25, min_fraction=0.25)
    policy.setup(8, "simulated")
    assert (policy.generate_devices, policy.judge_devices) == (6, 2)
    policy.update(telemetry(0, generate=10.0, judge=9.0))  # balanced: within hysteresis
    assert policy.judge_devices == 2
    policy.update(telemetry(1, generate=10.0, judge=20.0))  # judge cost rises: it idles less
    assert policy.judge_devices == 3
    policy.update(telemetry(2, generate=10.0, judge=2.0))  # and falls: a device goes back
    assert policy.judge_devices == 2
    for step in range(3, 10):  # bounds hold however idle the judge is
        policy.update(telemetry(step, generate=10.0, judge=0.1))
    assert policy.judge_devices == 2  # min_fraction 0.25 of 8


def test_same_decision_on_every_rank():
    decisions = []
    for _rank in range(2):
        policy = DynamicPlacement()
        policy.setup(64, "simulated")
        for step, judge in enumerate([30.0, 40.0, 5.0, 5.0]):
            policy.update(telemetry(step, 20.0, judge))
        decisions.append(policy.judge_devices)
    assert decisions[0] == decisions[1]


def test_placement_that_cannot_fit_fails_before_work():
    with pytest.raises(ConfigError, match="at least 2 devices"):
        DynamicPlacement().setup(1, "simulated")
    with pytest.raises(ConfigError, match="no room"):
        DynamicPlacement(min_fraction=0.6).setup(4, "simulated")
    with pytest.raises(ConfigError, match="GPU partitions"):
        DynamicPlacement().setup(4, "cuda")


def test_simulator_dynamic_follows_judge_cost(tmp_path):
    from gcore.placement.simulator import Workload, compare, load_workload, summarize

    cheap = Workload(samples_per_device=8, median_tokens=100, max_tokens=512, judge_output_tokens=8)
    runs = compare(16, 4, cheap, {"judge_fraction": 0.5})
    assert runs["dynamic"][-1].judge_devices < 8  # a cheap judge gives devices to generation
    costly = Workload(samples_per_device=8, median_tokens=100, max_tokens=512, judge_output_tokens=2000)
    runs = compare(16, 4, costly, {"judge_fraction": 0.25})
    assert runs["dynamic"][-1].judge_devices > 4  # a costly judge takes devices
    assert runs["static"][-1].judge_devices == 16
    summary = summarize(runs["static"], 16)
    assert 0 < summary["idle"] < 1 and summary["device_hours"] > 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("workload:\n  median_tokenz: 3\n")
    with pytest.raises(ConfigError, match="median_tokenz"):
        load_workload(str(bad))


def test_simulate_cli(tmp_path):
    from conftest import run_gcore

    pytest.importorskip("matplotlib")
    plot = tmp_path / "sim.png"
    result = run_gcore("simulate", "--devices", "16", "--steps", "3", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    assert "dynamic/static" in result.stdout and plot.stat().st_size > 0
