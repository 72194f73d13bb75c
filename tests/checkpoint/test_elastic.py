"""Faults and elastic resume with 2 controllers (gloo, CPU), through the CLI as a user runs them.

- one controller is SIGKILLed mid-run: the other stops promptly naming it, and ``resume auto`` goes on;
- a run checkpointed on 2 controllers resumes on 1, and one from 1 on 2, with the same weights and
  the global prompt stream where it was;
- on the same 2 controllers, with balancing on, a resumed run repeats the uninterrupted one exactly.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import FAST, RECORDING_REWARD
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TWO = ["--trainer.accelerator", "cpu", "--trainer.collective_timeout", "120"]




def _cmd(root, devices, *args):
    return [sys.executable, "-m", "gcore", "fit", *FAST, *TWO, "--trainer.devices", str(devices),
            "--trainer.default_root_dir", str(root), *args]


#: a fixed thread count for runs compared bit for bit: the governor's adapted counts change sums' last bit
FIXED_THREADS = {"OMP_NUM_THREADS": "1"}


def _fit(root, devices, *args, env=None):
    return subprocess.run(_cmd(root, devices, *args), capture_output=True, text=True, timeout=420,
                          env={**os.environ, **(env or {})})


def _runs(root):
    """metrics.csv rows of every run under ``root``, oldest first."""
    versions = sorted((v for v in os.listdir(os.path.join(root, "gcore")) if v.startswith("version_")),
                      key=lambda v: int(v.split("_")[1]))
    out = []
    for version in versions:
        path = os.path.join(root, "gcore", version, "metrics.csv")
        if os.path.exists(path):  # a resumed run with no step left to run logs nothing
            with open(path) as f:
                out.append(list(csv.DictReader(f)))
    return out


def _final_weights(root, version):
    return load_file(os.path.join(root, "gcore", f"version_{version}", "final", "model.safetensors"))


# -- one controller killed --------------------------------------------------------------------

def _newest_checkpoint(checkpoints):
    done = [int(p.name.split("_")[1]) for p in checkpoints.glob("step_*") if not p.name.endswith(".tmp")]
    return max(done, default=-1)


@pytest.mark.parametrize("victim", [1, 0])
def test_killing_one_controller_stops_the_run_naming_it_then_resume_auto_finishes(tmp_path, victim):
    process = subprocess.Popen(
        _cmd(tmp_path, 2, "--trainer.max_steps", "100000", "--trainer.checkpoint_every", "2",
             "--trainer.save_final", "false"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    checkpoints = tmp_path / "gcore" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and _newest_checkpoint(checkpoints) < 3 and process.poll() is None:
        time.sleep(0.1)
    assert process.poll() is None, process.communicate()
    children = psutil.Process(process.pid).children()
    assert len(children) == 1  # controller 0 launched controller 1
    os.kill(process.pid if victim == 0 else children[0].pid, signal.SIGKILL)
    killed_at = time.time()
    _, stderr = process.communicate(timeout=120)
    while True:  # the survivor, whichever it is, must exit by itself
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        assert time.time() - killed_at < 120, "a controller outlived its lost peer"
        time.sleep(0.2)
    survivor = 1 - victim
    if victim == 1:
        assert process.returncode != 0
        assert f"controller {survivor}: controller 1 was killed by SIGKILL" in stderr, stderr
    else:
        assert f"controller {survivor}: controller 0 is gone" in stderr, stderr
    assert "--trainer.resume auto" in stderr
    # before: the survivor's c10d logged the broken store connection with a C++ stack dump
    assert "Exception raised from" not in stderr and "frame #" not in stderr, stderr

    last = _newest_checkpoint(checkpoints)
    resumed = _fit(tmp_path, 2, "--trainer.max_steps", str(last + 3), "--trainer.resume", "auto",
                   "--trainer.save_final", "false")
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {last + 1}" in resumed.stdout
    assert [int(r["step"]) for r in _runs(tmp_path)[-1]] == list(range(last + 3))  # one metrics.csv


# -- elastic: 2 -> 1 and 1 -> 2 controllers ---------------------------------------------------

@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_elastic_resume_keeps_weights_and_data_position(tmp_path, before, after):
    (tmp_path / "recorder.py").write_text(RECORDING_REWARD)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) for i in range(10)))
    data = ["--data.path", str(tmp_path / "d.jsonl"), "--data.shuffle", "false", "--data.prompts_per_step", "4",
            "--reward", "python", "--reward.function", f"{tmp_path}/recorder.py:score"]
    logs = {name: tmp_path / name for name in ("a", "b", "c")}
    for folder in logs.values():
        folder.mkdir()
    runs = tmp_path / "runs"
    # steps 0-3 on `before` controllers; the last step is always checkpointed
    first = _fit(runs, before, *data, "--trainer.max_steps", "4", "--trainer.checkpoint_every", "2",
                 env={"GCORE_TEST_LOG": str(logs["a"])})
    assert first.returncode == 0, first.stderr
    saved = _final_weights(runs, 0)
    os.remove(runs / "gcore" / "version_0" / "final" / "model.safetensors")  # the resumed run writes it again
    # resume on `after` controllers with nothing left to run: the final model is the loaded one
    loaded = _fit(runs, after, *data, "--trainer.max_steps", "4", "--trainer.resume", "auto",
                  env={"GCORE_TEST_LOG": str(logs["b"])})
    assert loaded.returncode == 0, loaded.stderr
    assert "at step 4" in loaded.stdout
    assert f"written by {before} controller(s), running on {after}" in loaded.stdout
    restored = _final_weights(runs, 0)  # a resumed run writes into the folder of the run it continues
    assert saved.keys() == restored.keys()
    for name in saved:
        assert saved[name].equal(restored[name]), name
    # and the run goes on, from the prompt stream's position: prompts 16-23 of the epoch-wise stream
    goes_on = _fit(runs, after, *data, "--trainer.max_steps", "6", "--trainer.resume", "auto",
                   "--trainer.save_final", "false", env={"GCORE_TEST_LOG": str(logs["c"])})
    assert goes_on.returncode == 0, goes_on.stderr
    assert [r["step"] for r in _runs(runs)[-1]] == ["0", "1", "2", "3", "4", "5"]
    scored = sorted(json.loads(line) for f in logs["c"].iterdir() for line in f.read_text().splitlines())
    expected = sorted(f"{i % 10}=" for i in range(16, 24) for _ in range(2))  # n = 2 samples each
    assert scored == expected
    assert len(list(logs["c"].iterdir())) == after  # every controller took its share


# -- exact resume with 2 controllers and balancing ----------------------------------------------

KEYS = ("reward/mean", "loss", "entropy", "grad_norm", "response_length/mean", "balance/predicted_imbalance")


def test_two_controllers_resume_exactly_with_balancing(tmp_path):
    # 8 prompts of different lengths, 4 a step: from step 2 on each prompt was seen before, and its
    # learnt response length is part of its predicted cost, which sets the split over the controllers
    # and the logged imbalance (a resumed run that forgot the lengths predicts and splits differently)
    (tmp_path / "reward.py").write_text("def score(prompt, response, answer):\n    return float(answer in response)\n")
    rows = [{"prompt": "x" * length + "=", "answer": str(length % 10)} for length in (1, 2, 4, 7, 11, 16, 22, 29)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    balanced = ["--data.balance", "true", "--data.path", str(tmp_path / "d.jsonl"), "--trainer.save_final", "false",
                "--reward", "python", "--reward.function", f"{tmp_path}/reward.py:score"]
    whole = _fit(tmp_path, 2, "--trainer.max_steps", "6", "--trainer.checkpoint_every", "3", *balanced,
                 env=FIXED_THREADS)
    assert whole.returncode == 0, whole.stderr
    ckpt = tmp_path / "gcore" / "checkpoints" / "step_00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["sampler"]["lengths"]["per_prompt"]  # the learnt response lengths are in the checkpoint
    (first,) = _runs(tmp_path)
    resumed = _fit(tmp_path, 2, "--trainer.max_steps", "6", "--trainer.resume", str(ckpt), *balanced, env=FIXED_THREADS)
    assert resumed.returncode == 0, resumed.stderr
    (rows,) = _runs(tmp_path)  # the resumed run continues the same metrics.csv
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    second = rows[3:]
    for before, after in zip(first[3:], second, strict=False):
        for key in KEYS:
            assert before[key] == after[key], (key, before["step"], before[key], after[key])
