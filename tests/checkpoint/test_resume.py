"""Resuming: exact continuation on the same rank count, and surviving a SIGKILL."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import FAST

from gcore import GRPO, DataConfig, ModelConfig, SamplingParams, StaticPlacement, Trainer, TrainerConfig

pytestmark = pytest.mark.slow

KEYS = ("reward/mean", "loss", "entropy", "grad_norm", "response_length/mean")


def _rows(root):
    out = {}
    for version in sorted(os.listdir(os.path.join(root, "gcore"))):
        path = os.path.join(root, "gcore", version, "metrics.csv")
        if version.startswith("version_") and os.path.exists(path):
            with open(path) as f:
                out[version] = list(csv.DictReader(f))
    return out


def _fit(root, *args, **kwargs):
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", str(root), *FAST,
           "--trainer.save_final", "false", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])  # ppo: the critic and its optimizer come back too
def test_resume_continues_exactly(tmp_path, algorithm):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a fixed thread count: adapted counts change sums' last bit
    whole = _fit(tmp_path / "a", "--trainer.max_steps", "6", "--trainer.checkpoint_every", "3",
                 "--algorithm", algorithm, env=env)
    assert whole.returncode == 0, whole.stderr
    ckpt = tmp_path / "a" / "gcore" / "checkpoints" / "step_00000002"
    assert ckpt.is_dir()
    first = _rows(tmp_path / "a")["version_0"]
    resumed = _fit(tmp_path / "a", "--trainer.max_steps", "6", "--trainer.resume", str(ckpt), "--algorithm", algorithm,
                   env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout
    runs = _rows(tmp_path / "a")
    assert list(runs) == ["version_0"]  # the resumed run continues its own metrics.csv
    assert [r["step"] for r in runs["version_0"]] == ["0", "1", "2", "3", "4", "5"]
    assert runs["version_0"][:3] == first[:3]
    second = runs["version_0"][3:]  # steps 3-5 redone: one row each, the same values
    keys = KEYS + (("critic/value_loss", "critic/grad_norm", "clip_frac") if algorithm == "ppo" else ())
    for before, after in zip(first[3:], second, strict=False):
        for key in keys:
            assert before[key] == after[key], (key, before["step"], before[key], after[key])
    stalls = [row["checkpoint/stall_s"] for row in first]  # logged with the steps that saved (2 and 5)
    assert float(stalls[2]) >= 0 and float(stalls[5]) >= 0 and stalls[:2] == ["", ""]


def _compared(row):
    """A metrics row without the columns no two runs share (scripts/compare_runs.py's ``clock_column``)."""
    return {k: v for k, v in row.items() if not (k.startswith(("time/", "memory/", "threads/", "checkpoint/",
                                                                "placement/idle_")) or k.endswith(("_s", "gb_per_s")))}


@pytest.mark.integration
# (2, 2): the asynchronous path, two rollouts in flight over two workers; (0, 2): the synchronous loop over them.
# A third case, K = 1 over one worker (179 s of a CI run), went through the same code as (2, 2) with fewer rollouts
# in flight and one worker: the in-flight record and its resume (gcore/inflight.py) do not depend on either count.
@pytest.mark.parametrize(("max_staleness", "workers"), [(2, 2), (0, 2)])
def test_asynchronous_resume_over_engine_workers_continues_exactly(tmp_path, max_staleness, workers):
    """``--trainer.max_staleness K`` over static engine workers, stopped after step 1 with K rollouts in flight
    (recorded in the checkpoint: their tokens, log-probabilities, versions) and resumed: every metric but the
    clock's and the final weights equal those of the run that went on, and those of a run that saved nothing
    (the save waits for the generation in flight, and changes nothing). K = 0: the synchronous loop over two
    workers, which samples from a seed per request as well (before, each worker's own stream: not even two
    uninterrupted runs were equal)."""
    from safetensors.torch import load_file

    args = ("--placement.workers", str(workers), "--trainer.max_staleness", str(max_staleness),
            "--trainer.max_steps", "5", "--trainer.save_final", "true")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a fixed thread count: sums over other counts differ in the last bit
    plain = _fit(tmp_path / "plain", *args, env=env)
    assert plain.returncode == 0, plain.stderr
    whole = _fit(tmp_path / "a", *args, "--trainer.checkpoint_every", "2", "--trainer.keep_checkpoints", "5", env=env)
    assert whole.returncode == 0, whole.stderr
    first = _rows(tmp_path / "a")["version_0"]
    final = tmp_path / "a" / "gcore" / "version_0" / "final" / "model.safetensors"
    weights = load_file(final)
    ckpt = tmp_path / "a" / "gcore" / "checkpoints" / "step_00000001"
    resumed = _fit(tmp_path / "a", *args, "--trainer.resume", str(ckpt), env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 2" in resumed.stdout and "note" not in resumed.stdout, resumed.stdout
    rows = _rows(tmp_path / "a")["version_0"]
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]
    baseline = [_compared(r) for r in _rows(tmp_path / "plain")["version_0"]]
    assert [_compared(r) for r in first] == baseline
    assert [_compared(r) for r in rows] == baseline
    if max_staleness:
        assert rows[2]["async/staleness_max"] == str(float(min(2, max_staleness)))  # collected as recorded
    plain_final = tmp_path / "plain" / "gcore" / "version_0" / "final" / "model.safetensors"
    for other in (load_file(final), load_file(plain_final)):
        assert other.keys() == weights.keys() and all(torch.equal(other[k], weights[k]) for k in weights)


@pytest.mark.integration
def test_asynchronous_resume_on_dynamic_placement_collects_what_was_in_flight_and_says_it_is_not_exact(tmp_path):
    args = ("--placement", "dynamic", "--placement.workers", "2", "--trainer.max_staleness", "1",
            "--trainer.max_steps", "3")
    whole = _fit(tmp_path, *args, "--trainer.checkpoint_every", "2")
    assert whole.returncode == 0, whole.stderr
    ckpt = tmp_path / "gcore" / "checkpoints" / "step_00000001"
    resumed = _fit(tmp_path, *args, "--trainer.resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr
    notes = [line for line in resumed.stdout.splitlines() if "note" in line]
    assert len(notes) == 1 and "DynamicPlacement" in notes[0] and "not an exact continuation" in notes[0], notes
    rows = _rows(tmp_path)["version_0"]
    # step 2 trains on the rollout recorded in flight (one version old), not on one generated now
    assert rows[2]["step"] == "2" and rows[2]["async/staleness_max"] == "1.0"


class CountingGRPO(GRPO):
    """GRPO with state that changes during training: how many batches it has seen."""

    def __init__(self):
        super().__init__()
        self.batches = 0

    def advantages(self, batch):
        self.batches += 1
        return super().advantages(batch)

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


class CountingPlacement(StaticPlacement):
    """Static placement that counts its updates (stands in for a placement decision)."""

    def __init__(self):
        super().__init__()
        self.updates = 0

    def update(self, telemetry):
        self.updates += 1
        return {}

    def state_dict(self):
        return {"updates": self.updates}

    def load_state_dict(self, state):
        self.updates = state["updates"]


def test_algorithm_and_placement_state_come_back(tmp_path):
    def run(**trainer):
        algorithm, placement = CountingGRPO(), CountingPlacement()
        Trainer(trainer=TrainerConfig(default_root_dir=str(tmp_path), enable_progress_bar=False, save_final=False,
                                      **trainer),
                model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
                data=DataConfig(prompts_per_step=4), sampling=SamplingParams(n=2, max_new_tokens=4),
                algorithm=algorithm, placement=placement).fit()
        return algorithm, placement

    algorithm, placement = run(max_steps=4, checkpoint_every=2)
    assert (algorithm.batches, placement.updates) == (4, 4)
    ckpt = tmp_path / "gcore" / "checkpoints" / "step_00000001"
    assert json.loads((ckpt / "trainer_state.json").read_text())["algorithm"] == {"batches": 2}
    algorithm, placement = run(max_steps=4, resume=str(ckpt))  # fresh instances: counts start at 0
    assert (algorithm.batches, placement.updates) == (4, 4)  # 2 restored + steps 2 and 3


@pytest.mark.integration
def test_resume_auto_without_checkpoint_starts_fresh(tmp_path):
    result = _fit(tmp_path, "--trainer.resume", "auto")
    assert result.returncode == 0 and "starting from step 0" in result.stdout


@pytest.mark.integration
def test_killed_run_resumes_from_last_complete_checkpoint(tmp_path):
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", str(tmp_path), *FAST,
           "--trainer.max_steps", "100000", "--trainer.checkpoint_every", "2", "--trainer.save_final", "false"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoints = tmp_path / "gcore" / "checkpoints"
    deadline = time.time() + 240
    def newest():
        done = [int(p.name.split("_")[1]) for p in checkpoints.glob("step_*") if not p.name.endswith(".tmp")]
        return max(done, default=-1)

    while time.time() < deadline and newest() < 5:  # older checkpoints are pruned: look at the newest
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # no chance to clean up, possibly mid-save
    process.wait()
    complete = sorted(p.name for p in checkpoints.iterdir() if not p.name.endswith(".tmp"))
    assert complete, "no checkpoint was written before the kill"
    last = int(complete[-1].split("_")[1])
    resumed = _fit(tmp_path, "--trainer.max_steps", str(last + 3), "--trainer.resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {last + 1}" in resumed.stdout
    rows = list(_rows(tmp_path).values())[-1]
    assert [int(r["step"]) for r in rows] == list(range(last + 3))  # one metrics.csv, each step once
