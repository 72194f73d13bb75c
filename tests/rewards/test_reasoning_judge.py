"""The generative judge that writes a critique before its verdict (``--reward.template reasoning``): the verdict is
read from the reply's last ``Verdict:`` line; options refused in one line; the tiny model's judge counts what it
cannot parse in ``reward/errors``."""

from __future__ import annotations

import re

import pytest

from gcore.engines.hf import HFEngine
from gcore.errors import ConfigError
from gcore.model import ModelConfig, char_tokenizer, materialize
from gcore.rewards.generative import (
    DEFAULT_TEMPLATE,
    REASONING_TEMPLATES,
    VERDICT_LINE,
    GenerativeReward,
    parse_verdict,
)
from gcore.testing import tiny_fit
from gcore.types import Prompt, Sample

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
LINE = re.compile(VERDICT_LINE)


def sample(response: str, answer: str = "42", index: int = 0) -> Sample:
    return Sample(Prompt(index, "Which number is larger, 42 or 17?", [1], answer), 0, [1], [0.0], response, True)


# --- the verdict line, on replies of the kind SmolLM2-135M-Instruct writes (benchmarks/results/reasoning_judge.md) ---

@pytest.mark.parametrize(("reply", "reward"), [
    # the critique says "no" and "yes" before its verdict: only the last line counts (the plain yes_no reading
    # took the critique's first word)
    ("No doubt the reply picks 42, which is the larger number, so yes it is right.\nVerdict: no", 0.0),
    ("The reply's final answer is 17, not 42. No.\n\nVerdict: yes", 1.0),
    ("**Verdict:** Yes.", 1.0),
    ("The answer matches.\n**Verdict**: NO", 0.0),
    ("It says 42. Verdict: yes", 1.0),  # not on a line of its own: still read
    # a critique that quotes the format before its own verdict: the last one counts
    ("I should end with 'Verdict: yes' or 'Verdict: no'. The reply is wrong.\nVerdict: no", 0.0),
    ("verdict:yes", 1.0),
])
def test_the_last_verdict_line_is_the_verdict(reply, reward):
    assert parse_verdict(reply, "yes_no", 10, LINE) == reward


@pytest.mark.parametrize("reply", [
    "The reply says 42, which is the larger of the two numbers, so the reply is correct and",  # cut at the budget
    "Yes, the reply is correct.",  # a yes, but no verdict line
    "Verdict: maybe",
    "Verdict:",
    "",
])
def test_a_reply_without_a_readable_verdict_line_is_unparsable(reply):
    assert parse_verdict(reply, "yes_no", 10, LINE) is None
    assert parse_verdict(reply, "score", 10, LINE) is None


def test_a_score_verdict_line_is_scaled_and_the_critiques_numbers_are_not_read():
    reply = "The question compares 42 and 17; the reply answers 42.\nVerdict: 7/10"
    assert parse_verdict(reply, "score", 10, LINE) == 0.7
    assert parse_verdict(reply, "score", 10) is None  # the whole text: its first number, 42, is out of range
    assert parse_verdict("Verdict: 3 out of 5\nVerdict: 5/5", "score", 5, LINE) == 1.0
    assert parse_verdict("Verdict: 12/10", "score", 10, LINE) is None
    # SmolLM2-135M-Instruct echoing the template's placeholder: not 10/10 (the denominator was read before)
    assert parse_verdict("I'm glad you're pleased with the final answer. Verdict: N/10", "score", 10, LINE) is None
    assert parse_verdict("Verdict: 8 / 10", "score", 10, LINE) == 0.8


def test_a_verdict_pattern_of_ones_own_without_a_group_reads_its_whole_last_match():
    pattern = re.compile(r"(?i)\b(?:correct|incorrect)\b")  # a group of (?:...) counts as none
    assert parse_verdict("Correct reasoning, but the final answer is incorrect", "yes_no", 10, pattern) is None
    assert parse_verdict("FINAL: yes", "yes_no", 10, re.compile(r"FINAL: (yes|no)")) == 1.0
    assert parse_verdict("FINAL: maybe", "yes_no", 10, re.compile(r"FINAL: (yes|no)?")) is None  # group unused


# --- the options ----------------------------------------------------------------------------------------------------

def test_the_reasoning_template_sets_the_verdict_the_line_and_the_budget():
    reasoning = GenerativeReward("unused", template="reasoning")
    assert reasoning.template == REASONING_TEMPLATES["yes_no"] and "Verdict: yes" in reasoning.template
    assert reasoning.verdict == "yes_no" and reasoning.pattern is not None
    assert reasoning.pattern.pattern == VERDICT_LINE and reasoning.params.max_new_tokens == 128
    scored = GenerativeReward("unused", template="reasoning", verdict="score", max_score=5, max_new_tokens=64)
    assert scored.template == REASONING_TEMPLATES["score"] and scored.params.max_new_tokens == 64
    assert "Verdict: N/5" in scored._filled(sample("The answer is 42."))
    # unchanged: the one-token judge
    plain = GenerativeReward("unused")
    assert (plain.template, plain.verdict, plain.pattern, plain.params.max_new_tokens) == (
        DEFAULT_TEMPLATE, "probability", None, 8)
    assert GenerativeReward("unused", template="default").template == DEFAULT_TEMPLATE
    own = GenerativeReward("unused", template="Grade {response}. End with FINAL: yes or no.",
                           verdict_pattern=r"FINAL: (yes|no)")
    assert own.verdict == "yes_no" and own.params.max_new_tokens == 128 and own.pattern.groups == 1


@pytest.mark.parametrize(("options", "error"), [
    (dict(template="reasonning"), "--reward.template 'reasonning': neither a built-in template (valid choices: "
                                  "default, reasoning) nor a template with {response} in it"),
    (dict(template="reasoning", verdict="probability"),
     "--reward.template reasoning reads a verdict line after a critique: it needs a generated verdict, not "
     "--reward.verdict probability; valid choices: yes_no, score"),
    (dict(verdict_pattern="Verdict: (yes|no", verdict="yes_no"),
     "--reward.verdict_pattern 'Verdict: (yes|no': not a regular expression (missing ), unterminated subpattern"),
    (dict(verdict_pattern="(Verdict): (yes|no)"), "--reward.verdict_pattern '(Verdict): (yes|no)': 2 groups; it may "
                                                   "have at most one"),
    (dict(verdict_pattern="(yes|no)?"), "--reward.verdict_pattern '(yes|no)?' matches empty text"),
    (dict(verdict_pattern="Verdict: (yes|no)", verdict="probability"),
     "--reward.verdict_pattern reads the judge's generated text: it needs --reward.verdict yes_no or score, not "
     "probability"),
    (dict(template="reasoning", verdict="maybe"), "--reward.verdict 'maybe': valid choices: auto, probability, yes_no, "
                                                  "score"),
])
def test_bad_options_are_refused_in_one_line_naming_the_key(options, error):
    with pytest.raises(ConfigError) as caught:
        GenerativeReward("unused", **options)
    assert str(caught.value).startswith(error) and "\n" not in str(caught.value)


def test_the_cli_refuses_an_unknown_template_name_in_one_line(tmp_path, monkeypatch, capsys):
    from gcore.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["fit", "--trainer.default_root_dir", str(tmp_path / "runs"), "--reward", "generative",
                 "--reward.path", str(tmp_path / "judge"), "--reward.template", "critique"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "--reward.template 'critique': neither a built-in template (valid choices: default, reasoning)" in err


# --- with the tiny model's judge --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return materialize(ModelConfig(**TINY), char_tokenizer(), seed=0, workdir=str(tmp_path_factory.mktemp("judge")))


class Replies(HFEngine):
    """The tiny model's hf engine generating as usual, its replies then replaced by the given texts (tokenized
    with the judge's tokenizer, each ``finished`` as given): a judge whose critique and verdict are known. It keeps
    the prompts it was asked."""

    def __init__(self, tokenizer, replies: list[tuple[str, bool]]) -> None:
        super().__init__()
        self.tokenizer, self.replies, self.asked = tokenizer, replies, []

    def generate(self, prompts, params):
        self.asked += [self.tokenizer.decode(p) for p in prompts]
        self.budget = params.max_new_tokens
        outs = super().generate(prompts, params)
        for out, (text, finished) in zip(outs, self.replies[: len(outs)], strict=True):
            out[0].token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out[0].finished = finished
        del self.replies[: len(outs)]
        return outs


def test_the_tiny_judge_is_asked_the_reasoning_template_and_read_at_its_last_verdict_line(judge_dir):
    replies = [("The reply is wrong, no.\nVerdict: yes", True),
               ("yes, right... but 17 is smaller.\nVerdict: no", True),
               ("The reply says 42, which is the larger number, so the reply is corre", False),  # cut at the budget
               ("All fine.", True)]  # ended without a verdict line
    tokenizer = char_tokenizer()
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in replies]
    engine = Replies(tokenizer, replies)
    reward = GenerativeReward(judge_dir, engine=engine, template="reasoning", batch_size=4, unparsable_score=0.25)
    reward.setup("cpu")
    samples = [sample("The answer is 42.", index=i) for i in range(4)]
    assert reward.score(samples) == [1.0, 0.0, 0.25, 0.25]
    assert reward.last_errors == reward.last_unparsable == 2
    assert reward.last_replies == [tokenizer.decode(ids, skip_special_tokens=True) for ids in encoded]
    assert [s.reward_info["judge_tokens"] for s in samples] == [float(len(ids)) for ids in encoded]
    assert engine.budget == 128  # the critique's budget, not the one-word verdict's 8
    asked = engine.asked[0]  # the character tokenizer has no space: compared without them
    for part in ("Then end with a last line that is exactly 'Verdict: yes'", "The correct answer is 42.",
                 "Reply to grade: The answer is 42."):
        assert part.replace(" ", "") in asked
    assert reward.last_error.startswith("unparsable judge verdict 'The reply says 42") and (
        "(no verdict line; cut at --reward.max_new_tokens 128) for prompt 2, scored 0.25" in reward.last_error)
    assert [s.reward_info.get("judge_unparsable") for s in samples] == [None, None, 1.0, 1.0]


def test_a_run_with_the_tiny_reasoning_judge_counts_its_unparsable_verdicts_in_reward_errors(judge_dir):
    """A random tiny judge writes no verdict line: every sample is counted, each step, and scored 0."""
    reward = GenerativeReward(judge_dir, template="reasoning", max_new_tokens=6)
    result = tiny_fit(steps=2, reward=reward)
    assert [m["reward/errors"] for m in result.history] == [16.0, 16.0]
    assert [m["reward/mean"] for m in result.history] == [0.0, 0.0]
    assert "cut at --reward.max_new_tokens 6" in reward.last_error
