"""One run per run folder, and a resume that would continue another run."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gcore import GRPO, DataConfig, ModelConfig, SamplingParams, Trainer, TrainerConfig
from gcore.checkpoint import CheckpointError
from gcore.errors import ConfigError
from gcore.run_lock import RunLock

TINY = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}


def _trainer(root, steps=2, seed=42, **kwargs):
    return Trainer(trainer=TrainerConfig(max_steps=steps, default_root_dir=str(root), enable_progress_bar=False,
                                         save_final=False, seed=seed, **kwargs),
                   model=ModelConfig(**TINY), data=DataConfig(prompts_per_step=4),
                   sampling=SamplingParams(n=2, max_new_tokens=4), algorithm=GRPO())


def _hold_lock(folder):
    """Another process that holds the run folder's lock (as a running ``gcore fit`` does) until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from gcore.run_lock import RunLock
        RunLock({str(folder)!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.integration
def test_a_second_run_in_the_same_folder_is_refused_naming_the_first(tmp_path):
    holder = _hold_lock(tmp_path / "gcore")
    try:
        with pytest.raises(ConfigError, match=rf"gcore is in use by another gcore run \(pid {holder.pid} on "):
            _trainer(tmp_path).fit()
        assert not os.path.isdir(tmp_path / "gcore" / "checkpoints")  # refused before anything was written
        _trainer(tmp_path / "elsewhere", steps=1).fit()  # another folder is free
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.integration
def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    holder = _hold_lock(tmp_path / "gcore")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    lock = RunLock(str(tmp_path / "gcore"))
    lock.acquire()  # the kernel released the dead run's lock
    lock.release()
    _trainer(tmp_path, steps=1).fit()  # and a run that ended normally released its own
    _trainer(tmp_path, steps=1).fit()


def test_resume_of_another_seed_is_refused_unless_told(tmp_path):
    _trainer(tmp_path, steps=2, checkpoint_every=2).fit()
    with pytest.raises(CheckpointError, match=r"written by another run: --trainer.seed 42 \(this run: 7\).*"
                                              r"--trainer.resume_changed_run true"):
        _trainer(tmp_path, steps=3, seed=7, resume="auto").fit()
    result = _trainer(tmp_path, steps=3, seed=7, resume="auto", resume_changed_run=True).fit()
    assert [row["step"] for row in result.history] == [2.0]  # it continued from the checkpoint


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])  # the second: a service listening on every interface
def test_master_port_in_use_is_one_line_naming_it(tmp_path, monkeypatch, host):
    import socket

    busy = socket.socket()
    busy.bind((host, 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(port))
    try:
        with pytest.raises(ConfigError, match=rf"MASTER_PORT={port} is already in use on this machine"):
            _trainer(tmp_path, devices=2, accelerator="cpu").fit()
    finally:
        busy.close()
