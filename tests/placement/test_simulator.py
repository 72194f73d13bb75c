"""The simulator's asynchronous model: bounded staleness K and partial rollouts (gcore/simulator/)."""

from __future__ import annotations

import pytest

from gcore.errors import ConfigError
from gcore.placement import DynamicPlacement, StaticPlacement
from gcore.simulator.asynchronous import simulate_async
from gcore.simulator.cli import run_all
from gcore.simulator.model import Workload, compare, simulate, summarize


def _work(**overrides) -> Workload:
    base = dict(
        samples_per_device=8, median_tokens=100, max_tokens=1024, sigma=0.9, judge_output_tokens=32, swap_s=1.0,
        context_token_s=1e-5, resample_fraction=0.25,
    )
    return Workload(**{**base, **overrides})


def test_k0_is_the_synchronous_loop_unchanged():
    """K=0 runs ``model.simulate`` itself: the rows are equal field by field to the synchronous ones, and
    the first step of a small run keeps the values it had before the simulator moved (recorded from
    gcore/placement/simulator.py at main 73e42b2; the whole 50-step tables were compared bit-equal too)."""
    work = _work()
    runs = run_all(16, 3, work, {}, seed=1, max_staleness=0, partial_budget=0)
    again = compare(16, 3, work, {}, seed=1)
    assert list(runs) == ["static", "dynamic", "dynamic+release"]
    assert runs == again
    first = simulate(StaticPlacement(offload=True), 16, 1, work, seed=1)[0]
    assert (first.step_s, first.idle["generate"]) == (56.22679000000001, 495.49815)


@pytest.mark.parametrize("sigma", [0.3, 0.9, 1.3])
def test_k1_never_idles_more_than_k0(sigma):
    """Short, long and very long tails over 6 steps: overlapping generation with training does not
    add idle time. (Over 3 steps it can: the pipeline fills in the first and drains in the last,
    docs/simulator.md.)
    (Partial rollouts can: a budget below most responses' length pauses nearly all of them, see
    docs/simulator.md; with sigma 0.3 and a budget of 64 tokens, 0.64 of the median, they idle 5% more.)"""
    work = _work(sigma=sigma)
    runs = run_all(16, 6, work, {}, release_tail=False, max_staleness=1)
    idle = {name: summarize(results, 16)["idle_device_hours"] for name, results in runs.items()}
    assert idle["dynamic K=1"] <= idle["dynamic"]


@pytest.mark.parametrize(("k", "budget"), [(1, 0), (1, 48), (2, 0), (2, 48), (3, 48)])
def test_staleness_never_exceeds_k_and_reaches_it(k, budget):
    results = simulate_async(DynamicPlacement(), 16, 8, _work(), seed=2, max_staleness=k, partial_budget=budget)
    seen = {age for r in results for age, count in r.staleness.items() if count}
    assert max(seen) <= k
    assert k in seen  # the bound is used, so the test could fail
    assert min(seen) >= 0


def test_partial_rollouts_bound_each_steps_tail_by_the_budget():
    """With K as large as the run every response may pause, so no response generates more than the budget
    between two weight loads; without partial rollouts the longest responses run to the end in one go."""
    work = _work(sigma=1.2)
    plain = simulate_async(DynamicPlacement(), 16, 6, work, max_staleness=6)
    assert max(r.longest_segment for r in plain) > 100
    paused = simulate_async(DynamicPlacement(), 16, 6, work, max_staleness=6, partial_budget=100)
    assert max(r.longest_segment for r in paused) <= 100
    assert sum(sum(r.staleness.values()) for r in paused) > 0
    # the generation phase of a step is then no longer than serving every share at the budget
    assert max(r.stages["generate"] for r in paused) < max(r.stages["generate"] for r in plain)


def test_async_busy_and_idle_account_for_every_device_second():
    for budget in (0, 64):
        results = simulate_async(DynamicPlacement(), 16, 5, _work(), max_staleness=1, partial_budget=budget)
        for r in results:
            assert sum(r.busy.values()) + sum(r.idle.values()) == pytest.approx(16 * r.step_s)
            assert all(v >= -1e-9 for v in r.idle.values()), r.idle  # no device is booked twice
            assert r.train_devices >= 1 and r.generate_devices + r.judge_devices + r.train_devices == 16


def test_generation_of_the_next_step_overlaps_training():
    """Equal lengths, no judge cost to speak of: with K=1 the generation devices start the next batch
    while the current one trains, so a step takes less than generation plus training."""
    work = _work(sigma=0.0, resample_fraction=0.0, judge_output_tokens=1, train_token_s=0.002)
    sync = simulate_async(DynamicPlacement(), 16, 4, work, max_staleness=1)
    last = sync[-1]
    assert last.step_s < last.stages["generate"] + last.stages["train"]
    assert last.staleness == {1: sum(last.staleness.values())}  # every sample from the weights one step back


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-staleness", "-1"], "--max-staleness: '-1': expected an integer >= 0"),
        (["--max-staleness", "one"], "--max-staleness: 'one': expected an integer >= 0"),
        (["--max-staleness", "1", "--partial-rollouts", "0"], "--partial-rollouts: '0': expected a token budget >= 1"),
        (["--partial-rollouts", "64"], "--partial-rollouts needs --max-staleness >= 1"),
    ],
)
def test_bad_async_flags_give_one_line(args, message, capsys):
    from gcore.cli import main

    assert main(["simulate", "--devices", "8", "--steps", "1", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gcore: error: gcore simulate") and message in lines[0], lines


def test_async_needs_the_dynamic_placement():
    with pytest.raises(ConfigError, match="dynamic placement"):
        simulate_async(StaticPlacement(offload=True), 16, 2, _work())  # type: ignore[arg-type]


def test_async_timeline_by_hand():
    """4 devices: training is 8 of the first batch's 52 device-seconds, so 1 trains; of the other 3,
    2 generate and 1 judges (the split held). Each generation device decodes its 2 responses of 10
    tokens in 10 s (1 s a step), the judge gives the 4 verdicts in one 1 s step, training takes 2 s,
    loading weights 0.5 s. Batch 0: generated by 10, judged by 11, trained 11-13. Batch 1 (K=1 lets
    it start on version 0): 10-20, judged 21, trained 21-23. Batch 2 needs version 1 (there from
    13): loads it at 20 (0.5 s), 20.5-30.5, judged 31.5, trained 31.5-33.5. Steps: 13, 10, 10.5 s."""
    work = Workload(
        samples_per_device=1, prompt_tokens=0, median_tokens=10, sigma=0.0, max_tokens=100, length_drift=0.0,
        decode_step_s=1.0, generate_token_s=0.0, judge_token_s=0.0, judge_generate_token_s=0.0,
        judge_output_tokens=1, judge_decode_step_s=1.0, swap_s=0.5, train_token_s=0.0, train_step_s=2.0,
    )
    results = simulate_async(DynamicPlacement(hysteresis=1e9), 4, 3, work, max_staleness=1)
    assert [(r.train_devices, r.generate_devices, r.judge_devices) for r in results] == [(1, 2, 1)] * 3
    assert [r.step_s for r in results] == [13.0, 10.0, 10.5]
    assert [r.staleness for r in results] == [{0: 4}, {1: 4}, {1: 4}]
    # step 1 (13-23): each generation device decodes 13-20 and 20.5-23 and loads weights 20-20.5
    assert results[1].busy["generate"] == pytest.approx(2 * 9.5) and results[1].idle["swap"] == pytest.approx(1.0)
    assert results[1].idle["generate"] == pytest.approx(0.0)
    assert results[1].idle["train"] == pytest.approx(10.0 - 2.0)
