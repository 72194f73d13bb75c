"""Rewards against real components: math-verify, a tiny local classifier and a tiny local judge LLM."""

from __future__ import annotations

import pytest
import torch

from gcore.engines.hf import HFEngine
from gcore.errors import ConfigError, RewardError
from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize
from gcore.rewards.base import RuleReward, as_reward
from gcore.rewards.classifier import ClassifierReward
from gcore.rewards.combined import CombinedReward
from gcore.rewards.generative import GenerativeReward, parse_verdict
from gcore.rewards.math import MathReward, final_answer
from gcore.rewards.rule import RegexReward
from gcore.types import Prompt, Sample

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)


def sample(response: str, answer: str | None = None, prompt: str = "q") -> Sample:
    return Sample(Prompt(0, prompt, [1], answer), 0, [1], [0.0], response, True)


def test_final_answer_conventions():
    assert final_answer(r"x \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert final_answer("So the answer is 42.") == "42"
    assert final_answer("no idea") is None


def test_math_reward_equivalence():
    reward = MathReward(missing_score=-1.0)
    samples = [
        sample(r"thus \boxed{\frac{1}{2}}", "0.5"),
        sample("The answer is 7", "7"),
        sample(r"\boxed{3}", "4"),
        sample("I give up", "4"),
    ]
    assert reward.score(samples) == [1.0, 1.0, 0.0, -1.0]


def test_combined_weights_and_parts():
    reward = CombinedReward([MathReward(), RegexReward(r"\\boxed")], weights=[1.0, 0.5])
    samples = [sample(r"\boxed{2}", "2"), sample(r"\boxed{3}", "2"), sample("2", "2")]
    assert reward.score(samples) == [1.5, 0.5, 0.0]
    assert samples[0].reward_info == {"0_MathReward": 1.0, "1_RegexReward": 1.0}
    with pytest.raises(ConfigError):
        CombinedReward([MathReward()], weights=[1.0, 2.0])


class Returns(RuleReward):
    """A rule reward that returns what it is given, as a user's reward function might."""

    def __init__(self, values, on_error="raise"):
        super().__init__(on_error)
        self.values = list(values)

    def score_one(self, sample):
        return self.values.pop(0)


def test_a_reward_names_its_generative_judge_and_placement_can_point_it_elsewhere(tmp_path):
    rule = RegexReward(r"\d")
    judge = GenerativeReward(str(tmp_path / "judge"), trust_remote_code=True)
    assert rule.judges() == []
    (found,) = CombinedReward([rule, judge]).judges()  # a combined reward returns its parts' judges
    assert found.source == ModelSource(str(tmp_path / "judge"), torch.float32, trust_remote_code=True)
    assert found.engine is judge.engine  # configured, not set up: what a worker builds a copy of
    elsewhere = HFEngine()
    found.use(elsewhere)
    assert judge.engine is elsewhere
    assert len(CombinedReward([judge, GenerativeReward("other")]).judges()) == 2


def test_rewards_are_finite_numbers_and_bools_count_as_one_or_zero():
    from decimal import Decimal

    import numpy as np

    assert [as_reward(v) for v in (1, 0.5, True, False, np.float32(0.25), np.bool_(True), torch.tensor(2.0),
                                   torch.tensor(0.5, requires_grad=True), 2e30)] \
        == [1.0, 0.5, 1.0, 0.0, 0.25, 1.0, 2.0, 0.5, 2e30]
    for bad, kind in (("0.5", "str"), (None, "NoneType"), ([1.0], "list"), (torch.ones(2), "Tensor"),
                      (Decimal("0.5"), "Decimal"), (0.5 + 0j, "complex")):
        with pytest.raises(TypeError, match=f"must be a number, got {kind}"):
            as_reward(bad)
    for bad in (float("nan"), float("inf"), -float("inf"), np.float64("nan")):
        with pytest.raises(ValueError, match="must be finite"):
            as_reward(bad)


@pytest.mark.parametrize(("value", "message"), [
    (float("nan"), "returned nan: a reward must be finite, got nan"),
    (float("inf"), "returned inf: a reward must be finite, got inf"),
    ("0.5", "returned '0.5': a reward must be a number, got str '0.5'"),
])
def test_a_non_finite_or_non_number_reward_names_the_sample_unless_scored_zero(value, message):
    samples = [sample("fine"), sample("bad response", prompt="the prompt")]
    samples[1].prompt.source = "data.jsonl:7"
    with pytest.raises(RewardError) as err:
        Returns([1.0, value]).score(samples)
    text = str(err.value)
    assert message in text and "data.jsonl:7: 'the prompt'" in text and "'bad response'" in text, text
    assert "--reward.on_error zero" in text and "\n" not in text
    zero = Returns([1.0, value, 0.5], on_error="zero")
    assert zero.score(samples + [sample("ok")]) == [1.0, 0.0, 0.5]
    assert zero.last_errors == 1 and message in zero.last_error


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = char_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id, **TINY)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("classifier")
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_classifier_batches_match_single(classifier_dir):
    samples = [sample("abc"), sample("a much longer response"), sample("z")]
    batched = ClassifierReward(classifier_dir, batch_size=2)
    batched.setup("cpu")
    one = ClassifierReward(classifier_dir, batch_size=1)
    one.setup("cpu")
    a, b = batched.score(samples), one.score(samples)
    assert len(a) == 3 and a != [a[0]] * 3
    assert a == pytest.approx(b, abs=1e-4)  # padding does not change a sample's score


def test_classifier_bad_label(classifier_dir):
    with pytest.raises(ConfigError, match="labels"):
        ClassifierReward(classifier_dir, label=3).setup("cpu")


def test_parse_verdict():
    assert parse_verdict(" Yes, it is", "yes_no", 10) == 1.0
    assert parse_verdict("no.", "yes_no", 10) == 0.0
    assert parse_verdict("maybe", "yes_no", 10) is None
    assert parse_verdict("score: 7/10", "score", 10) == 0.7
    assert parse_verdict("15", "score", 10) is None


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    config = ModelConfig(**TINY)
    return materialize(config, char_tokenizer(), seed=0, workdir=str(tmp_path_factory.mktemp("judge")))


def test_generative_unparsable_is_counted(judge_dir):
    """A random tiny judge never says yes/no: every sample is counted unparsable, none silently scored."""
    reward = GenerativeReward(judge_dir, verdict="yes_no", max_new_tokens=4, batch_size=2, unparsable_score=-1.0)
    reward.setup("cpu")
    samples = [sample("r1", "1"), sample("r2", "2"), sample("r3", "3")]
    assert reward.score(samples) == [-1.0] * 3
    assert reward.last_errors == reward.last_unparsable == 3
    assert reward.last_error.startswith("unparsable judge verdict") and "scored -1.0" in reward.last_error
    assert all(s.reward_info["judge_unparsable"] == 1.0 for s in samples)
    strict = GenerativeReward(judge_dir, verdict="yes_no", max_new_tokens=4, unparsable_score=None)
    strict.setup("cpu")
    with pytest.raises(RewardError, match="unparsable"):
        strict.score(samples[:1])


class FlakyEngine(HFEngine):
    """A real HF engine whose first ``failures`` calls raise (a judge worker that died)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def _fail(self):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("judge worker died")

    def generate(self, prompts, params):
        self._fail()
        return super().generate(prompts, params)

    def next_token_logprobs(self, prompts, candidates):
        self._fail()
        return super().next_token_logprobs(prompts, candidates)


@pytest.mark.parametrize("verdict", ["probability", "yes_no"])
def test_generative_retries_then_fails_clearly(judge_dir, verdict):
    reward = GenerativeReward(judge_dir, engine=FlakyEngine(1), verdict=verdict, max_new_tokens=2, retries=1)
    reward.setup("cpu")
    assert len(reward.score([sample("r", "1")])) == 1
    reward = GenerativeReward(judge_dir, engine=FlakyEngine(5), verdict=verdict, max_new_tokens=2, retries=1)
    reward.setup("cpu")
    with pytest.raises(RewardError, match="failed 2 times"):
        reward.score([sample("r", "1")])


def _p_yes(path: str, ids: list[int], yes: list[int], no: list[int]) -> float:
    """P(yes) / (P(yes) + P(no)) from a plain forward of the judge model on ``ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
    return float(probs[yes].sum() / (probs[yes].sum() + probs[no].sum()))


def test_the_probability_verdict_is_p_yes_over_p_yes_plus_p_no(judge_dir):
    """The default verdict, on a tiny random judge (character tokenizer, no chat template): each reward is
    P(yes) / (P(yes) + P(no)) of the judge's next token, summed over the first tokens of yes/Yes and
    no/No (a leading space is one token here, the same for yes and no: it counts for neither)."""
    from transformers import AutoTokenizer

    reward = GenerativeReward(judge_dir, batch_size=2)
    assert reward.verdict == "probability"
    reward.setup("cpu")
    tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    yes, no = tokenizer.convert_tokens_to_ids(["y", "Y"]), tokenizer.convert_tokens_to_ids(["n", "N"])
    assert (sorted(reward.yes_ids), sorted(reward.no_ids)) == (sorted(yes), sorted(no))
    samples = [sample("The answer is 3.", "3"), sample("", "3"), sample("4 is larger.", "4", prompt="4 or 2?")]
    scores = reward.score(samples)
    for s, score in zip(samples, scores, strict=True):
        text = reward.template.format(prompt=s.prompt.text, response=s.response_text, answer=s.prompt.answer)
        assert reward.judge_prompt(s) == text  # no chat template to apply
        assert score == pytest.approx(_p_yes(judge_dir, tokenizer(text)["input_ids"], yes, no), abs=1e-5)
    assert len(set(scores)) == 3 and all(0 < v < 1 for v in scores)
    assert reward.last_errors == 0 and not any(s.reward_info for s in samples)


@pytest.fixture(scope="module")
def templated_judge_dir(judge_dir, tmp_path_factory):
    """The tiny judge with a chat template: ``[`` + the user message + ``]`` then ``>`` as the generation prompt."""
    import shutil

    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("templated") / "judge")
    shutil.copytree(judge_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
                               "{% if add_generation_prompt %}>{% endif %}")
    tokenizer.save_pretrained(path)
    return path


def test_the_judge_prompt_goes_through_the_chat_template_unless_disabled(templated_judge_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(templated_judge_dir)
    yes, no = tokenizer.convert_tokens_to_ids(["y", "Y"]), tokenizer.convert_tokens_to_ids(["n", "N"])
    s = sample("The answer is 3.", "3")
    templated, plain = GenerativeReward(templated_judge_dir), GenerativeReward(templated_judge_dir, chat_template=False)
    for reward in (templated, plain):
        reward.setup("cpu")
    text = templated.template.format(prompt="q", response="The answer is 3.", answer="3")
    assert templated.judge_prompt(s) == f"[{text}]>"
    assert plain.judge_prompt(s) == text
    # the verdict is read right after the generation prompt; the template writes the special tokens itself
    templated_ids = tokenizer(f"[{text}]>", add_special_tokens=False)["input_ids"]
    assert templated.score([s])[0] == pytest.approx(_p_yes(templated_judge_dir, templated_ids, yes, no), abs=1e-5)
    assert plain.score([s])[0] == pytest.approx(
        _p_yes(templated_judge_dir, tokenizer(text)["input_ids"], yes, no), abs=1e-5)


def test_an_engine_without_next_token_logprobs_fails_at_config(judge_dir):
    from gcore.engines.base import Engine

    class TextOnly(Engine):
        def setup(self, source, device):
            pass

        def generate(self, prompts, params):
            raise AssertionError("not called")

        def update_weights(self, weights):
            return 0

    with pytest.raises(ConfigError) as caught:
        GenerativeReward(judge_dir, engine=TextOnly())
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--reward.verdict probability needs an engine")
    assert "TextOnly" in message and message.endswith("valid choices: probability, yes_no, score")
    GenerativeReward(judge_dir, engine=TextOnly(), verdict="yes_no")  # a free-text verdict needs no log-probabilities
    with pytest.raises(ConfigError,
                       match=r"^--reward.verdict 'maybe': valid choices: auto, probability, yes_no, score$"):
        GenerativeReward(judge_dir, verdict="maybe")  # type: ignore[arg-type]

    class Refusing(HFEngine):  # e.g. a pool worker whose own engine has none: it raises at the first score
        def next_token_logprobs(self, prompts, candidates):
            raise NotImplementedError("the VLLMEngine engine does not give next-token log-probabilities")

    reward = GenerativeReward(judge_dir, engine=Refusing(), retries=3)
    reward.setup("cpu")
    with pytest.raises(ConfigError, match=r"^--reward.verdict probability: the VLLMEngine engine does not give .*"
                                          r"valid choices: probability, yes_no, score$"):
        reward.score([sample("r", "1")])


class Calls(RuleReward):
    """A rule reward that runs ``fn(sample)``, as a user's reward function would."""

    def __init__(self, fn, **options):
        super().__init__(**options)
        self.fn = fn

    def score_one(self, sample):
        return self.fn(sample)


def _exits(_):
    import sys

    sys.exit(0)


def _interrupts(_):
    raise KeyboardInterrupt


class _Odd(BaseException):
    pass


def _odd(_):
    raise _Odd("not an Exception")


@pytest.mark.parametrize(("fn", "raised"), [
    (_exits, "raised SystemExit: 0"), (_interrupts, "raised KeyboardInterrupt"),
    (_odd, "raised _Odd: not an Exception"),
])
def test_a_reward_that_exits_or_interrupts_itself_is_its_error_on_that_sample(fn, raised):
    # before: SystemExit and KeyboardInterrupt left score() (a run exited 0 or read it as Ctrl-C)
    samples = [sample("bad response", prompt="the prompt")]
    samples[0].prompt.source = "data.jsonl:3"
    with pytest.raises(RewardError, match=rf"^Calls {raised} on sample \(prompt data.jsonl:3: 'the prompt', "
                                          r"response: 'bad response'\); pass --reward.on_error zero"):
        Calls(fn).score(samples)
    zero = Calls(lambda s: fn(s) if s.response_text == "bad" else 1.0, on_error="zero")
    assert zero.score([sample("bad"), sample("good")]) == [0.0, 1.0]
    assert zero.last_errors == 1 and raised in zero.last_error


def test_a_reward_that_does_not_return_is_ended_by_its_timeout_naming_the_sample():
    import threading

    def spins(_):  # pure Python: stopped once given up on
        while True:
            pass

    with pytest.raises(RewardError, match=r"^Calls did not return within 0.5 s \(--reward.timeout\) on sample "
                                          r"\(prompt 0: 'q', response: 'stuck'\); pass --reward.on_error zero"):
        Calls(spins, timeout=0.5).score([sample("stuck")])
    release = threading.Event()  # blocked in C (a lock): cannot be stopped, runs on until released
    reward = Calls(lambda s: release.wait() if s.response_text == "stuck" else 0.5, timeout=0.5, on_error="zero")
    try:
        assert reward.score([sample("a"), sample("stuck"), sample("b")]) == [0.5, 0.0, 0.5]
        assert reward.last_errors == 1 and "did not return within 0.5 s" in reward.last_error
    finally:
        release.set()
    with pytest.raises(ConfigError, match="--reward.timeout must be >= 0"):
        Calls(spins, timeout=-1)


def test_timed_out_calls_that_cannot_be_stopped_stop_the_run_before_they_pile_up(monkeypatch):
    import threading

    from gcore.rewards import base

    monkeypatch.setattr(base, "MAX_STUCK_CALLS", 2)
    release = threading.Event()
    reward = Calls(lambda s: release.wait(), timeout=0.2, on_error="zero")
    try:
        with pytest.raises(RewardError, match=r"calls of Calls that ran past --reward.timeout are still running"):
            reward.score([sample(str(i)) for i in range(4)])
    finally:
        release.set()


@pytest.mark.timeout(120)  # a hang here would otherwise hold the suite for the global 600 s
def test_ctrl_c_while_a_reward_runs_still_stops_the_run():
    import os
    import signal
    import threading

    started, release = threading.Event(), threading.Event()

    def slow(_):
        started.set()
        release.wait()
        return 1.0

    def press_ctrl_c():
        while not started.wait(0.05):
            if release.is_set():  # the reward never started
                return
        os.kill(os.getpid(), signal.SIGINT)

    reward = Calls(slow, timeout=0)
    # Python's own Ctrl-C handler, whatever an earlier test in this process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):  # the signal, not the reward's error: no RewardError
            reward.score([sample("a")])
    finally:
        release.set()
        presser.join()
        signal.signal(signal.SIGINT, previous)


def test_a_reward_model_whose_score_exits_is_a_reward_error():
    # a plugin's own score(): before, SystemExit went through (exit 0 with nothing saved)
    from gcore.rewards.base import RewardModel

    class Exits(RewardModel):
        def score(self, samples):
            raise SystemExit(0)

    with pytest.raises(RewardError, match=r"^Exits.score raised SystemExit: 0 on 2 samples; the first: prompt 0"):
        Exits().score([sample("a"), sample("b")])


def test_a_reward_too_large_for_float32_is_named_with_its_value():
    # before: 10**400 raised OverflowError from float(), 1e300 passed and became inf in the float32 batch
    for value, shown in ((10**400, "an int of about 401 digits"), (1e300, "1e+300"), (-(10**39), "-1e+39")):
        with pytest.raises(RewardError, match=rf"^Returns returned .*: a reward must be within float32's range "
                                              rf"\(\+-3.403e\+38\), got {shown.replace('+', '[+]')} on sample"):
            Returns([value]).score([sample("x")])
    assert as_reward(3.0e38) == 3.0e38
