"""Every plugin's ``setup`` runs once per controller (``Environment.setup``: "called once per controller before
the first episode"): counted, per process, in a one-process run and in a run of two controllers."""

from __future__ import annotations

import collections
import os

import pytest
from conftest import run_gcore

pytestmark = pytest.mark.integration

PLUGINS = '''
import os

from gcore.envs.base import Environment, Turn
from gcore.rewards.rule import TargetCharReward


def _count(kind):
    with open(os.environ["GCORE_SETUP_LOG"], "a") as f:
        f.write(f"{kind} {os.getpid()}\\n")


class CountingEnv(Environment):
    """Multi-turn episodes of one turn each, counting ``setup``."""

    def setup(self, tokenizer):
        _count("env")
        super().setup(tokenizer)

    def step(self, state, response):
        return Turn(done=True)


class CountingReward(TargetCharReward):
    def setup(self, device):
        _count("reward")
        super().setup(device)
'''


@pytest.mark.parametrize("devices", [1, 2])
def test_every_plugin_is_set_up_once_per_controller(tmp_path, monkeypatch, devices):
    (tmp_path / "counting_plugins.py").write_text(PLUGINS)
    log = tmp_path / "setup.log"
    monkeypatch.setenv("GCORE_SETUP_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    result = run_gcore("fit", "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.max_steps", "1",
                       "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false",
                       "--data.prompts_per_step", "4", "--sampling.n", "2", "--trainer.devices", str(devices),
                       "--trainer.accelerator", "cpu", "--env", "counting_plugins.CountingEnv",
                       "--reward", "counting_plugins.CountingReward", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = collections.Counter(tuple(line.split()) for line in log.read_text().splitlines())
    pids = {pid for _, pid in calls}
    assert len(pids) == devices, calls  # one controller per process
    assert calls == {(kind, pid): 1 for kind in ("env", "reward") for pid in pids}, calls
