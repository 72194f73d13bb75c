"""Bad input that used to be accepted silently: non-finite or non-number rewards, runs whose every
update is skipped, a judge's unparsable verdicts, a model folder without a tokenizer, resuming past
``--trainer.max_steps``. Each now fails with one line naming the cause, or is counted in a metric."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from gcore.algorithms.grpo import GRPO
from gcore.errors import ConfigError, GcoreError, RewardError
from gcore.model import ModelConfig, char_tokenizer, load_tokenizer, materialize
from gcore.rewards.generative import GenerativeReward
from gcore.rewards.rule import CallableReward
from gcore.testing import tiny_fit
from gcore.trainer import Trainer, TrainerConfig

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 64}


def _reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "rewards.py"
    path.write_text("import math\n\ndef score(prompt, response, answer):\n" + body + "\n")
    return f"{path}:score"


def test_a_nan_reward_stops_the_run_naming_the_sample(tmp_path):
    # before: the run went on with every update skipped, exited 0 and saved final/
    with pytest.raises(RewardError, match=r"CallableReward returned nan: a reward must be finite, got nan on sample "
                                          r"\(prompt <[^>]+>:\d+: .*, response: .*\); pass --reward.on_error zero"):
        tiny_fit(steps=2, reward=CallableReward(_reward_file(tmp_path, "    return math.nan")))


def test_with_on_error_zero_non_finite_rewards_are_counted_and_zeroed(tmp_path):
    # every other call is infinite; the rest score 1 when the answer character is in the response
    body = ("    score.calls = getattr(score, 'calls', 0) + 1\n"
            "    return math.inf if score.calls % 2 else float(answer in response)")
    result = tiny_fit(steps=2, reward=CallableReward(_reward_file(tmp_path, body), on_error="zero"))
    for metrics in result.history:
        assert metrics["reward/errors"] == metrics["samples/total"] / 2 == 8
        assert metrics["skipped_updates"] == 0  # the update ran on the finite rewards
        assert 0 <= metrics["reward/mean"] <= 0.5


class NaNLoss(GRPO):
    """GRPO whose advantages are NaN: every update has a non-finite loss and is skipped."""

    def advantages(self, batch):
        return super().advantages(batch) * float("nan")


def test_consecutive_skipped_updates_stop_the_run(tmp_path):
    # before: all steps ran, every update skipped, and the run "succeeded"
    with pytest.raises(GcoreError, match=r"^step 2: 3 steps in a row skipped their update because the loss or the "
                                         r"gradient was NaN or infinite \(loss nan.*--trainer.max_skipped_updates"):
        tiny_fit(steps=6, algorithm=NaNLoss())


def test_the_judge_warns_once_per_step_and_counts_unparsable_verdicts(tmp_path, caplog):
    # before: one warning line per unparsable verdict (16 a step here)
    judge = materialize(ModelConfig(**TINY), char_tokenizer(), seed=0, workdir=str(tmp_path / "judge"))
    with caplog.at_level(logging.WARNING):
        result = tiny_fit(steps=2, reward=GenerativeReward(judge, verdict="yes_no", max_new_tokens=2))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("gcore")]
    assert len(warnings) == 2, warnings  # a random tiny judge never says yes or no: 16 unparsable a step
    assert all("16 sample(s) could not be scored" in w and "unparsable judge verdict" in w for w in warnings)
    assert [m["reward/errors"] for m in result.history] == [16.0, 16.0]


def test_a_model_folder_without_tokenizer_files_says_so(tmp_path):
    # before: transformers built an empty tokenizer and the data said "the prompt tokenizes to nothing"
    folder = tmp_path / "notok"
    materialize(ModelConfig(**TINY), char_tokenizer(), seed=0, workdir=str(folder))
    for name in os.listdir(folder):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(folder / name)
    with pytest.raises(ConfigError, match=rf"^--model.path {folder}: no tokenizer files in the folder \(none of "
                                          r"tokenizer.json, tokenizer_config.json"):
        load_tokenizer(ModelConfig(path=str(folder)))


def test_resuming_past_max_steps_is_an_error_before_the_model_is_built(tmp_path):
    # before: "resumed ... at step 3", no step run, rc 0 and a final/ model
    def trainer(max_steps):
        return Trainer(trainer=TrainerConfig(max_steps=max_steps, default_root_dir=str(tmp_path), checkpoint_every=1,
                                             enable_progress_bar=False, save_final=False, resume="auto",
                                             async_checkpoint=False),
                       model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64))

    trainer(3).fit()
    checkpoint = tmp_path / "gcore" / "checkpoints" / "step_00000002"
    assert checkpoint.is_dir()
    with pytest.raises(ConfigError, match=rf"^--trainer.max_steps 2 is below the 3 steps already trained in the "
                                          rf"checkpoint {checkpoint}: nothing to train"):
        trainer(2).fit()
    assert len(os.listdir(tmp_path / "gcore")) == 2  # no new run folder: it failed before starting one
    assert trainer(3).fit().history == []  # exactly at max_steps: nothing left, not an error
    shutil.rmtree(tmp_path)


# --- config files: one line naming the file and line (before: jsonargparse's message, the file unnamed) ---------

def _fit_error(tmp_path, monkeypatch, capsys, *args: str) -> str:
    """``gcore fit ARGS`` in this process, from ``tmp_path``: its one line on stderr (the run must fail in parsing)."""
    from gcore.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["fit", "--trainer.default_root_dir", str(tmp_path / "runs"), *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
    assert not (tmp_path / "runs").exists()  # refused before anything was built
    return err.strip()


@pytest.mark.parametrize(("text", "error"), [
    ("trainer:\n  max_steps: 2\n  name: [unclosed\n",
     "cfg.yaml:4:1: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence at line 3, column 9)"),
    ("trainer:\n  max_steps: 2\n    name: x\n", "cfg.yaml:3:9: mapping values are not allowed here"),
    ("trainer: !!python/object/apply:os.system ['true']\n",
     "cfg.yaml:1:10: could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"),
    ("trainer:\n  max_steps: !!python/object/new:builtins.int [2]\n",
     "cfg.yaml:2:14: could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/new:builtins.int'"),
], ids=["unclosed", "indent", "python-apply", "python-new"])
def test_a_config_file_that_is_not_yaml_names_its_line_and_column(tmp_path, monkeypatch, capsys, text, error):
    (tmp_path / "cfg.yaml").write_text(text)
    assert _fit_error(tmp_path, monkeypatch, capsys, "--config", "cfg.yaml") == f"gcore: error: --config {error}"


def _choices(names) -> str:
    return ", ".join(names)


def test_an_unknown_key_in_a_config_file_names_the_file_line_and_valid_choices(tmp_path, monkeypatch, capsys):
    import dataclasses

    from gcore import registry

    trainer = _choices(f.name for f in dataclasses.fields(TrainerConfig))
    (tmp_path / "typo.yaml").write_text("trainer:\n  max_steps: 2\n  checkpoint_evry: 1\n")
    assert _fit_error(tmp_path, monkeypatch, capsys, "--config", "typo.yaml") == (
        "gcore: error: typo.yaml:3: unknown option trainer.checkpoint_evry (did you mean trainer.checkpoint_every?); "
        f"valid choices under trainer: {trainer} (gcore fit --help lists the options)")
    (tmp_path / "top.yaml").write_text("model:\n  hidden_size: 32\ntrainr:\n  max_steps: 2\n")
    sections = _choices(["trainer", "model", "data", "sampling", *registry.GROUPS])
    assert _fit_error(tmp_path, monkeypatch, capsys, "--config", "top.yaml") == (
        f"gcore: error: top.yaml:3: unknown option trainr (did you mean trainer?); valid choices: {sections} "
        "(gcore fit --help lists the options)")


def test_an_unknown_plugin_option_names_the_line_the_class_and_its_options(tmp_path, monkeypatch, capsys):
    import inspect

    grpo = set(inspect.signature(GRPO).parameters) - {"options"}
    (tmp_path / "plugin.yaml").write_text("algorithm:\n  class_path: grpo\n  init_args:\n    klcoef: 0.1\n")
    error = _fit_error(tmp_path, monkeypatch, capsys, "--config", "plugin.yaml")
    head, choices = error.removesuffix(" (gcore fit --help lists the options)").split(
        "; valid choices under algorithm: ")
    assert head == ("gcore: error: plugin.yaml:4: unknown option algorithm.klcoef of gcore.algorithms.grpo.GRPO "
                    "(did you mean algorithm.kl_coef?)")
    assert grpo <= set(choices.split(", "))  # GRPO's own, and those it passes on to Algorithm
    # the same option on the command line is named as a flag
    error = _fit_error(tmp_path, monkeypatch, capsys, "--algorithm.klcoef", "0.1")
    assert error.startswith("gcore: error: unknown option --algorithm.klcoef of gcore.algorithms.grpo.GRPO (did you "
                            "mean --algorithm.kl_coef?); valid choices under --algorithm: ")


@pytest.mark.parametrize(("text", "flags", "error"), [
    ("trainer:\n  max_steps: 2\n  seed: abc\n", [],
     "cfg.yaml:3: trainer.seed: Expected a <class 'int'>. Got value: abc (gcore fit --help lists the options)"),
    ("reward:\n  class_path: generative\n  init_args:\n    max_new_tokens: lots\n", [],
     "cfg.yaml:4: reward.max_new_tokens: Expected a <class 'int'>. Got value: lots (gcore fit --help lists the "
     "options)"),
    ("trainer:\n  max_steps: -1\n", [], "cfg.yaml:2: trainer.max_steps must be >= 1, got -1"),
    ("placement:\n  class_path: dynamic\n  init_args:\n    workers: -2\n", [],
     "cfg.yaml:4: placement.workers must be >= 0 (0: one per core), got -2"),
    # the command line's value overrides the file's: the flag is named
    ("trainer:\n  max_steps: -1\n", ["--trainer.max_steps", "0"], "--trainer.max_steps must be >= 1, got 0"),
    ("sampling:\n  n: 4\n", ["--trainer.seed=xyz"],
     "--trainer.seed: Expected a <class 'int'>. Got value: xyz (gcore fit --help lists the options)"),
], ids=["type", "plugin-type", "check", "plugin-check", "flag-check", "flag-type"])
def test_a_bad_value_in_a_config_file_names_the_file_and_line(tmp_path, monkeypatch, capsys, text, flags, error):
    """A value of the wrong type, or one a check refuses, names the config file and line that set it; a flag that
    overrides the file is named as a flag."""
    (tmp_path / "cfg.yaml").write_text(text)
    assert _fit_error(tmp_path, monkeypatch, capsys, "--config", "cfg.yaml", *flags) == f"gcore: error: {error}"
