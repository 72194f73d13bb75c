"""A plugin's code that ends the process (``sys.exit``, a ``KeyboardInterrupt`` of its own, another
``BaseException``) stops the run with one line naming the plugin's family, class and method (exit status 2
from the CLI, the checkpoints kept), where before ``sys.exit(0)`` in an engine, a placement, a backend or an
environment ended the run with exit status 0 and nothing said. A real signal is still Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from conftest import FAST

from gcore.backends.torch import TorchBackend
from gcore.cli import main
from gcore.engines.hf import HFEngine
from gcore.envs.base import SingleTurn
from gcore.errors import PluginExit
from gcore.placement.static import StaticPlacement
from gcore.testing import tiny_fit
from gcore.user_code import culprit


class _ExitingEngine(HFEngine):
    def generate(self, prompts, params):
        sys.exit(0)


class _InterruptingBackend(TorchBackend):
    def train(self, batch, algorithm):
        raise KeyboardInterrupt  # its own, no signal


class _RefusingBackend(TorchBackend):
    def validate(self, algorithm, world_size, single_controller):
        sys.exit(1)  # checked when the Trainer is made, before any run


class _ExitingPlacement(StaticPlacement):
    def launch(self, engine, reward, source, device, seed=0):
        sys.exit("no room")


class _EndingEnv(SingleTurn):
    def setup(self, tokenizer):
        raise GeneratorExit


@pytest.mark.parametrize(("plugins", "where", "raised"), [
    ({"engine": _ExitingEngine()}, "engine _ExitingEngine.generate", "SystemExit: 0"),
    ({"backend": _InterruptingBackend()}, "backend _InterruptingBackend.train", "KeyboardInterrupt"),
    ({"backend": _RefusingBackend()}, "backend _RefusingBackend.validate", "SystemExit: 1"),
    ({"placement": _ExitingPlacement()}, "placement _ExitingPlacement.launch", "SystemExit: no room"),
    ({"env": _EndingEnv()}, "env _EndingEnv.setup", "GeneratorExit"),
], ids=["engine", "backend", "backend-validate", "placement", "env"])
def test_a_plugin_whose_code_ends_the_process_stops_the_run_naming_it(plugins, where, raised):
    # before: the SystemExit (or the plugin's own KeyboardInterrupt, read as Ctrl-C) left Trainer.fit
    with pytest.raises(PluginExit) as err:
        tiny_fit(steps=1, **plugins)
    assert str(err.value) == f"{where} raised {raised}; a plugin's code must raise an exception, not end the process"


class _SignalledEngine(HFEngine):
    def generate(self, prompts, params):
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered while the plugin's code runs
        time.sleep(5)
        raise AssertionError("the signal did not interrupt the engine")


def test_a_real_ctrl_c_during_a_plugins_code_is_still_an_interrupt():
    with pytest.raises(KeyboardInterrupt) as err:
        tiny_fit(steps=1, engine=_SignalledEngine())
    assert not isinstance(err.value, PluginExit)


class _Caller:
    def run(self, other: _Caller | None = None) -> None:
        if other is None:
            sys.exit(3)
        other.run()


def test_the_exit_is_blamed_on_the_innermost_plugin_running_and_on_none_outside_plugins():
    plugin, outside = _Caller(), _Caller()
    with pytest.raises(SystemExit) as err:
        plugin.run(outside)  # the plugin calls code that is no plugin's, which exits
    assert culprit(err.value, [("engine", plugin)]) == "engine _Caller.run"
    assert culprit(err.value, [("engine", plugin), ("backend", outside)]) == "backend _Caller.run"
    assert culprit(err.value, [("engine", _Caller())]) is None


def test_a_plugin_that_exits_ends_the_cli_run_in_one_line_keeping_its_checkpoints(tmp_path, monkeypatch, capsys):
    # before: exit status 0, no message, the run folder as if it had succeeded
    (tmp_path / "exiting_backend.py").write_text(
        "import sys\nfrom gcore.backends.torch import TorchBackend\n\n\nclass ExitingBackend(TorchBackend):\n"
        "    calls = 0\n\n    def train(self, batch, algorithm):\n        ExitingBackend.calls += 1\n"
        "        if ExitingBackend.calls == 3:\n            sys.exit(0)\n"
        "        return super().train(batch, algorithm)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "runs"
    code = main(["fit", "--trainer.default_root_dir", str(root), *FAST, "--backend", "exiting_backend.ExitingBackend",
                 "--trainer.max_steps", "4", "--trainer.checkpoint_every", "1"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "gcore: error: backend ExitingBackend.train raised SystemExit: 0; a plugin's code must raise an exception, "
        "not end the process"), err[-3000:]
    checkpoints = root / "gcore" / "checkpoints"
    # steps 0 and 1 were saved (the second asynchronously, maybe in flight when step 2 failed): both complete
    assert sorted(os.listdir(checkpoints)) == ["step_00000000", "step_00000001"], os.listdir(checkpoints)
    assert all((checkpoints / step / "manifest.json").is_file() for step in os.listdir(checkpoints))
