"""Resuming: exact continuation on the same rank count, and surviving a SIGKILL."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAST

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


def test_resume_continues_exactly(tmp_path):
    whole = _fit(tmp_path / "a", "--trainer.max_steps", "6", "--trainer.checkpoint_every", "3")
    assert whole.returncode == 0, whole.stderr
    ckpt = tmp_path / "a" / "gcore" / "checkpoints" / "step_00000002"
    assert ckpt.is_dir()
    resumed = _fit(tmp_path / "a", "--trainer.max_steps", "6", "--trainer.resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout
    runs = _rows(tmp_path / "a")
    first, second = runs["version_0"], runs["version_1"]
    assert [r["step"] for r in second] == ["3", "4", "5"]
    for before, after in zip(first[3:], second):
        for key in KEYS:
            assert before[key] == after[key], (key, before["step"], before[key], after[key])


def test_resume_auto_without_checkpoint_starts_fresh(tmp_path):
    result = _fit(tmp_path, "--trainer.resume", "auto")
    assert result.returncode == 0 and "starting from step 0" in result.stdout


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
    assert [int(r["step"]) for r in rows] == [last + 1, last + 2]
