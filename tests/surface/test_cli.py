"""The command line, run as a user runs it: in a fresh process. Its help, printed configs and the refusals made
while parsing or building the plugins are read from ``main`` called in the test's process (``run_gcore_here``): a
fresh process would only import gcore again (12-45 s each on the 2 cores)."""

import csv
import dataclasses
import json
import sys

import pytest
from conftest import run_gcore_here

from gcore import registry
from gcore.trainer import TrainerConfig

pytestmark = pytest.mark.integration

# the installed plugins, as the CLI lists them: adding an algorithm or an engine changes no test here
ALGORITHMS, ENGINES = ", ".join(registry.names("algorithm")), ", ".join(registry.names("engine"))


def _metrics(tmp_path):
    (path,) = (tmp_path / "runs").glob("gcore/version_*/metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def test_fit_writes_metrics_and_final_checkpoint(gcore_cli, tmp_path):
    result = gcore_cli("--algorithm", "grpo", "--placement", "static")
    assert result.returncode == 0, result.stderr
    assert "trained policy (HF checkpoint):" in result.stdout
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == ["0", "1"]
    for key in ("reward/mean", "reward/std", "response_length/mean", "loss", "entropy", "time/generate",
                "time/reward", "time/prepare", "time/train", "time/sync", "sync/gb_per_s"):
        assert rows[-1][key] != "", key
    (final,) = (tmp_path / "runs").glob("gcore/version_*/final")
    assert (final / "config.json").exists() and (final / "tokenizer.json").exists()


def test_kl_is_logged_when_used_and_tensorboard_logger(gcore_here, tmp_path):
    """A 2-step ``gcore fit`` through ``main`` in this process (``test_fit_writes_metrics_and_final_checkpoint`` runs
    one in a fresh process): the option's value reaches the algorithm and the logger list reaches the loggers."""
    result = gcore_here("--algorithm.kl_coef", "0.1", "--trainer.logger", "[csv, tensorboard]")
    assert result.returncode == 0, result.stderr
    assert float(_metrics(tmp_path)[-1]["kl"]) >= 0
    assert list((tmp_path / "runs").glob("gcore/version_*/events.out.tfevents.*"))


def test_config_file_with_plugin_names_and_overrides(gcore_cli, gcore_here, tmp_path):
    (tmp_path / "cfg.yaml").write_text(
        "algorithm:\n  class_path: grpo\n  init_args:\n    clip_eps: 0.3\nreward: target_char\n"
    )
    printed = gcore_here("--config", "cfg.yaml", "--algorithm.loss_agg", "token_mean", "--print_config")
    assert printed.returncode == 0, printed.stderr
    assert "class_path: gcore.algorithms.grpo.GRPO" in printed.stdout or "class_path: gcore.GRPO" in printed.stdout
    assert "clip_eps: 0.3" in printed.stdout and "loss_agg: token_mean" in printed.stdout
    (tmp_path / "printed.yaml").write_text(printed.stdout)
    again = gcore_cli("--config", "printed.yaml", fast=False)  # a printed config runs as it is
    assert again.returncode == 0, again.stderr


def test_a_plugin_chosen_on_the_command_line_overrides_the_config_files(gcore_here, tmp_path):
    """`--config` names one reward; `--reward NAME --reward.OPTION` after it picks another and sets its option
    (the choice used to be moved before the file, which then chose its own class back)."""
    (tmp_path / "cfg.yaml").write_text("reward: target_char\nalgorithm: grpo\n")
    printed = gcore_here("--config", "cfg.yaml", "--reward", "regex", "--reward.pattern", "a+", "--print_config")
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert "gcore.rewards.rule.RegexReward" in printed.stdout and "pattern: a+" in printed.stdout


def test_class_path_for_a_plugin(gcore_here):
    result = gcore_here("--algorithm", "gcore.algorithms.grpo.GRPO", "--algorithm.scale_rewards", "false")
    assert result.returncode == 0, result.stderr


def test_plugins_lists_every_family_with_its_package():
    # through main in this process; a fresh `gcore plugins` lists an installed plugin package in
    # tests/surface/test_plugin_package.py (and in .ci/run)
    result = run_gcore_here("plugins")
    assert result.returncode == 0
    for line in ("grpo", "hf", "static", "dynamic", "torch", "target_char", "python", "regex"):
        assert line in result.stdout
    assert "[gcore 0.1.0]" in result.stdout


def test_help_shows_plugin_options():
    result = run_gcore_here("fit", "--algorithm.help", "grpo")
    assert result.returncode == 0 and "--algorithm.clip_eps" in result.stdout
    result = run_gcore_here("fit", "--help")
    assert {"dapo", "grpo", "ppo", "rloo"} <= set(registry.names("algorithm"))
    assert result.returncode == 0 and f"--algorithm: {ALGORITHMS} (default grpo)" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algorithm", "nope"], f"unknown algorithm 'nope'; valid choices: {ALGORITHMS}"),
        (["--engine=nope"], f"unknown engine 'nope'; valid choices: {ENGINES}"),
        (["--model.path", "/does/not/exist"], "--model.path '/does/not/exist' is not a directory"),
        (["--data.path", "missing.jsonl"], "--data.path missing.jsonl: no such file"),
        (["--trainer.devices", "2", "--trainer.controllers", "1", "--placement", "dynamic"],  # before any launch
         "--trainer.controllers 1 runs with --placement static and no --placement.workers"),
        (["--trainer.devices", "2", "--trainer.controllers", "1", "--placement.workers", "2"],  # StaticPlacement
         "--trainer.controllers 1 runs with --placement static and no --placement.workers"),
        (["--trainer.devices", "2", "--trainer.controllers", "1", "--backend.sequence_parallel_size", "2"],
         "--trainer.controllers 1 does not support --backend.sequence_parallel_size > 1"),  # TorchBackend.validate
        (["--sampling.n", "0"], "--sampling.n must be >= 1"),
        (["--sampling.top_k", "-3"], "--sampling.top_k must be >= 0 (0: no top-k), got -3"),
        (["--trainer.checkpoint_every", "-1"], "--trainer.checkpoint_every must be >= 0 (0: no checkpoints), got -1"),
        (["--reward", "regex", "--reward.pattern", "("], "is not a valid regular expression"),
    ],
)
def test_bad_input_is_one_clear_line(gcore_cli, gcore_here, args, message):
    # refused while parsing or building the plugins: in this process; those that must come before the controllers
    # are launched (--trainer.devices 2) in a fresh one, where a late refusal would launch them
    result = (gcore_cli if "--trainer.devices" in args else gcore_here)(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_dataset_names_file_and_line(gcore_here, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": oops}\n')
    result = gcore_here("--data.path", "d.jsonl")
    assert result.returncode == 2 and "d.jsonl:2: malformed JSON line" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message, fresh", [
    (["--trainer.max_steps", "abc"], "--trainer.max_steps: Expected a <class 'int'>. Got value: abc", True),
    (["--algorithm.clip_eps", "abc"], "--algorithm.clip_eps: Expected a <class 'float'>. Got value: abc", False),
    (["--trainer.nonexistent", "3"], "unknown option --trainer.nonexistent; valid choices under --trainer: "
     + ", ".join(f.name for f in dataclasses.fields(TrainerConfig)), False),
])
def test_a_value_of_the_wrong_type_is_one_line_without_the_usage(gcore_cli, gcore_here, args, message, fresh):
    """The whole of stderr is the one line: in a fresh process once (nothing its imports print comes before it),
    the other refusals of the same parser in this process."""
    result = (gcore_cli if fresh else gcore_here)(*args)
    assert result.returncode == 2 and result.stderr.strip() == f"gcore: error: {message} (gcore fit --help lists " \
                                                                 "the options)"


def test_unknown_config_key_is_named(gcore_here):
    result = gcore_here("--algorithm.clip_epsilon", "0.2")
    assert result.returncode == 2 and "clip_epsilon" in result.stderr


def test_reward_that_raises_stops_naming_the_sample_unless_told_to_score_zero(gcore_here, tmp_path):
    """Two 2-step ``gcore fit`` runs through ``main`` in this process (a fresh one would only import gcore again)."""
    (tmp_path / "myreward.py").write_text(
        "def score(prompt, response, answer):\n"
        "    if prompt.startswith('3'):\n        raise ValueError('cannot score this one')\n"
        "    return float(answer in response)\n"
    )
    rows = [{"prompt": f"{d}=", "answer": str(d)} for d in range(10)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    common = ["--data.path", "d.jsonl", "--data.prompts_per_step", "10", "--reward", "python",
              "--reward.function", "myreward.py:score"]
    result = gcore_here(*common)
    assert result.returncode == 2
    assert "ValueError: cannot score this one on sample (prompt d.jsonl:4: '3='" in result.stderr
    assert "--reward.on_error zero" in result.stderr
    result = gcore_here(*common, "--reward.on_error", "zero")
    assert result.returncode == 0, result.stderr
    assert float(_metrics(tmp_path)[-1]["reward/errors"]) == 2.0  # n=2 samples of prompt '3=' per step


def test_vllm_engine_without_vllm_names_the_extra(gcore_here):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    result = gcore_here("--engine", "vllm")
    assert result.returncode == 2
    assert "--engine vllm needs vLLM" in result.stderr and "gcore[vllm]" in result.stderr


def test_wandb_logger_without_wandb_says_what_to_install(gcore_here):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    result = gcore_here("--trainer.logger", "wandb")
    assert result.returncode == 2 and "--trainer.logger wandb needs wandb" in result.stderr
    assert "pip install 'gcore[wandb]'" in result.stderr


def test_the_gcore_command_skips_the_last_full_collection(monkeypatch, capsys):
    """``gcore`` and ``python -m gcore`` run ``entry``: ``main``, then ``gc.freeze()`` so that the interpreter's
    last full collection at exit is skipped (1.8 s of CPU per process here); ``main`` alone, which tests call in
    their own process, freezes nothing."""
    import gc

    from gcore.cli import entry, main

    gc.unfreeze()
    monkeypatch.setattr(sys, "argv", ["gcore", "--help"])
    try:
        assert main() == 0 and gc.get_freeze_count() == 0
        assert entry() == 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert "gcore fit" in capsys.readouterr().out
