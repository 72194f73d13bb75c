"""The ``routed`` reward: real rule rewards and a tiny local judge LLM, each scoring the samples routed to it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import tomllib

from gcore.engines.hf import HFEngine
from gcore.errors import ConfigError, RewardError
from gcore.model import ModelConfig, char_tokenizer, materialize
from gcore.rewards.generative import GenerativeReward
from gcore.rewards.math import MathReward
from gcore.rewards.routed import RoutedReward
from gcore.rewards.rule import RegexReward, TargetCharReward
from gcore.types import Prompt, Sample

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)


def sample(response: str, route: str | None, answer: str | None = None, index: int = 0) -> Sample:
    metadata = {} if route is None else {"reward": route}
    prompt = Prompt(index, f"q{index}", [1], answer, f"data.jsonl:{index + 1}", metadata)
    return Sample(prompt, index, [1], [0.0], response, True)


def counted(reward):
    """``reward`` whose ``score`` records the prompt indices of each call in ``reward.calls``."""
    score, reward.calls = reward.score, []

    def record(samples):
        reward.calls.append([s.prompt.index for s in samples])
        return score(samples)

    reward.score = record
    return reward


def test_each_sample_is_scored_by_its_route_once_per_call_in_the_samples_order():
    math, regex = counted(MathReward()), counted(RegexReward(r"^yes"))
    reward = RoutedReward({"math": math, "style": regex})
    samples = [sample("The answer is 3.", "math", "3", 0), sample("yes", "style", index=1),
               sample("The answer is 4.", "math", "5", 2), sample("no", "style", index=3),
               sample(r"\boxed{7}", "math", "7", 4)]
    assert reward.score(samples) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert math.calls == [[0, 2, 4]] and regex.calls == [[1, 3]]  # one call per route, its samples in order
    assert [s.reward_info for s in samples[:2]] == [{"route_math": 1.0}, {"route_style": 1.0}]
    assert reward.score([sample("yes", "style")]) == [1.0] and math.calls == [[0, 2, 4]]  # no call without samples
    assert reward.score([]) == [] and regex.calls == [[1, 3], [0]]


def test_a_reward_serving_two_routes_is_called_once():
    math = counted(MathReward())
    reward = RoutedReward({"math": math, "dapo_math": math})
    samples = [sample("The answer is 1.", "math", "1", 0), sample("The answer is 2.", "dapo_math", "1", 1)]
    assert reward.score(samples) == [1.0, 0.0] and math.calls == [[0, 1]]
    assert samples[1].reward_info == {"route_dapo_math": 0.0}


def test_an_unknown_or_missing_route_names_the_prompt_and_the_valid_routes_unless_a_default_takes_it():
    routes = {"math": MathReward(), "style": RegexReward("yes")}
    with pytest.raises(RewardError, match=r"prompt data.jsonl:2: metadata 'reward' is 'poetry', not a route; "
                                          r"valid routes: math, style"):
        RoutedReward(routes).score([sample("x", "math", "1", 0), sample("x", "poetry", index=1)])
    with pytest.raises(RewardError, match=r"prompt data.jsonl:1: no metadata 'reward' to route by.*metadata_keys"):
        RoutedReward(routes).score([sample("x", None)])
    by_default = RoutedReward(routes, default="style")
    assert by_default.score([sample("yes", "poetry"), sample("yes", None), sample("The answer is 1.", "math", "1")]) \
        == [1.0] * 3
    by_source = RoutedReward(routes, key="data_source")
    assert by_source.score([Sample(Prompt(0, "q", [1], metadata={"data_source": "style"}), 0, [1], [0.0], "yes",
                                   True)]) == [1.0]


def test_routes_are_checked_when_built():
    with pytest.raises(ConfigError, match="at least one route"):
        RoutedReward({})
    with pytest.raises(ConfigError, match=r"--reward.default 'judge' is not a route; valid routes: math"):
        RoutedReward({"math": MathReward()}, default="judge")


def test_judges_are_the_routes_judges(tmp_path):
    judge, other = GenerativeReward(str(tmp_path / "judge")), GenerativeReward(str(tmp_path / "other"))
    assert RoutedReward({"math": MathReward()}).judges() == []
    found = RoutedReward({"math": MathReward(), "open": judge, "chat": other}).judges()
    assert [j.source.path for j in found] == [str(tmp_path / "judge"), str(tmp_path / "other")]
    (shared,) = RoutedReward({"open": judge, "chat": judge}).judges()  # one judge serving two routes
    elsewhere = HFEngine()
    shared.use(elsewhere)
    assert judge.engine is elsewhere


def test_a_prompt_is_judged_when_its_route_has_a_judge(tmp_path):
    """``judged``: what a placement predicts the next rollout's judging from (its routes, a prompt without one
    counting as not judged: its samples' scoring says so in one line)."""
    from gcore.rewards.combined import CombinedReward

    judge = GenerativeReward(str(tmp_path / "judge"))
    routed = RoutedReward({"math": MathReward(), "open": judge})
    prompts = [sample("", route, index=i).prompt for i, route in enumerate(["math", "open", None, "poetry"])]
    assert [routed.judged(p) for p in prompts] == [False, True, False, False]
    assert [RoutedReward({"math": MathReward(), "open": judge}, default="open").judged(p) for p in prompts] == [
        False, True, True, True]
    assert [judge.judged(p) for p in prompts] == [True] * 4 and not MathReward().judged(prompts[1])
    assert [CombinedReward([MathReward(), routed]).judged(p) for p in prompts] == [False, True, False, False]


class CountingEngine(HFEngine):
    """A real HF engine that counts its ``generate`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        return super().generate(prompts, params)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return materialize(ModelConfig(**TINY), char_tokenizer(), seed=0, workdir=str(tmp_path_factory.mktemp("judge")))


def test_a_judge_route_judges_its_samples_in_one_batch_and_errors_add_up(judge_dir):
    """A random tiny judge never says yes/no: its samples are unparsable (errors), as is a target_char
    sample without an answer; the routed reward counts both routes' errors and keeps the first one."""
    engine = CountingEngine()
    judge = GenerativeReward(judge_dir, engine=engine, verdict="yes_no", max_new_tokens=2, batch_size=64,
                             unparsable_score=-1.0)
    char = TargetCharReward(length=4, on_error="zero")
    reward = RoutedReward({"char": char, "judge": judge, "math": MathReward()})
    reward.setup("cpu")  # every route is set up
    assert judge.tokenizer is not None
    samples = [sample("7777", "char", "7", 0), sample("a", "judge", index=1), sample("77", "char", None, 2),
               sample("b", "judge", index=3), sample("The answer is 2.", "math", "2", 4), sample("c", "judge", index=5)]
    assert reward.score(samples) == [1.0, -1.0, 0.0, -1.0, 1.0, -1.0]
    assert engine.calls == 1  # the three judged samples in one judge call
    assert reward.last_errors == 1 + 3
    assert reward.last_error.startswith("TargetCharReward raised ValueError")  # the first route's first error
    assert reward.score([sample("7777", "char", "7")]) == [1.0] and (reward.last_errors, reward.last_error) == (0, None)


def test_the_routed_entry_point_is_declared():
    """``--reward routed`` resolves through the installed entry points (read from pyproject.toml at install)."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    module, _, name = pyproject["project"]["entry-points"]["gcore.rewards"]["routed"].partition(":")
    assert getattr(importlib.import_module(module), name) is RoutedReward
