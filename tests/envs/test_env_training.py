"""Multi-turn episodes through the whole step: every algorithm, the worker placements, and the one-step-off loop."""

import math

import pytest

from gcore import DAPO, GRPO, PPO, RLOO, DynamicPlacement, StaticPlacement, Trainer, TrainerConfig
from gcore.data import DataConfig
from gcore.envs.reveal import RevealEnvironment
from gcore.model import ModelConfig
from gcore.tracing import read_samples
from gcore.types import SamplingParams


def _fit(tmp_path, steps=2, **plugins):
    trainer = plugins.pop("trainer", {})
    return Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              save_final=False, **trainer),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(task="reveal", prompts_per_step=4),
        sampling=SamplingParams(n=4, max_new_tokens=6),
        env=plugins.pop("env", RevealEnvironment()),
        **plugins,
    ).fit()


def _assert_episodes(history, prompts=4, n=4):
    for metrics in history:
        assert metrics["env/episodes"] >= prompts * n and metrics["env/turns_mean"] == 2.0
        assert metrics.get("env/errors", 0.0) == 0.0
        assert metrics["response_length/max"] > 6  # two turns and the observation between them
        assert math.isfinite(metrics["loss"])


@pytest.mark.parametrize("make", [GRPO, PPO, RLOO, lambda: DAPO(max_rounds=2)], ids=["grpo", "ppo", "rloo", "dapo"])
def test_every_algorithm_trains_on_two_turn_episodes(tmp_path, make):
    result = _fit(tmp_path, algorithm=make())
    _assert_episodes(result.history)
    # rollout tracing: each episode's turns and whole transcript; PPO's per-token advantages as a mean per sample
    records = read_samples(result.run_dir)
    assert len(records) == 2 * 8 and all(r["turns"] == 2 and len(r["transcript"]) > len(r["reply"]) for r in records)
    assert {r["finish_reason"] for r in records} <= {"stop", "cut"}
    assert any(r["advantage"] not in (None, 0.0) for r in records)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("placement, staleness", [  # static workers without overlap: as the async run's step 0
    (lambda: DynamicPlacement(workers=2), 0),
    (lambda: DynamicPlacement(workers=2), 1),
    (lambda: StaticPlacement(workers=2), 2),
], ids=["dynamic", "dynamic-async", "static-workers-async-2"])
def test_episodes_on_engine_workers(tmp_path, placement, staleness):
    result = _fit(tmp_path, steps=3, placement=placement(), trainer={"max_staleness": staleness})
    _assert_episodes(result.history)
    if staleness:  # the episodes of steps 1 and 2 ran while a step before trained, with its weights
        assert [m["async/staleness_max"] for m in result.history] == [0.0, 1.0, min(2.0, staleness)]
        assert all(m["async/regenerated_stale"] == 0.0 for m in result.history)


class Fixed(RevealEnvironment):
    """Rewards the revealing turn 0.25 and the answer 0.5, whatever the model writes."""

    def step(self, state, response):
        turn = super().step(state, response)
        turn.reward = 0.5 if turn.done else 0.25
        turn.metrics = {"tool_calls": 1.0}  # as a tool environment counts them
        return turn


def test_environment_rewards_are_summed_into_the_reward(tmp_path):
    from gcore.rewards.rule import NoReward

    result = _fit(tmp_path, env=Fixed(), reward=NoReward())
    assert [m["reward/mean"] for m in result.history] == [0.75, 0.75]
    records = read_samples(result.run_dir)  # rollout tracing: each episode's own reward and counts
    assert {r["env_reward"] for r in records} == {0.75}
    assert {r["tool_calls"] for r in records} == {2.0} and {r["env_metrics"]["tool_calls"] for r in records} == {2.0}


def test_held_out_evaluation_runs_whole_episodes(tmp_path):
    """``--trainer.eval_every`` with a multi-turn environment evaluates whole episodes: the reveal task's
    answer comes only in the second turn, so an evaluation of first turns alone would see one turn each."""
    result = _fit(tmp_path, steps=1, trainer={"eval_every": 1})
    evaluations = result.evaluations
    assert len(evaluations) == 2  # before the first step and after the last
    for metrics in evaluations:
        assert metrics["eval/turns_mean"] == 2.0 and 0.0 <= metrics["eval/accuracy_greedy"] <= 1.0
