"""The reward rises on the embedded default task, for each algorithm with its defaults."""

import pytest

from gcore import DAPO, GRPO, PPO, Trainer, TrainerConfig


def _rewards(tmp_path, algorithm, steps=30):
    result = Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              save_final=False),
        algorithm=algorithm,
    ).fit()
    return [m["reward/mean"] for m in result.history], result.history


def _assert_rises(rewards):
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > 3 * first and last - first > 0.1, rewards


@pytest.mark.slow
def test_grpo_reward_rises_on_the_embedded_task(tmp_path):
    rewards, _ = _rewards(tmp_path, GRPO())
    _assert_rises(rewards)


@pytest.mark.slow
def test_ppo_reward_rises_on_the_embedded_task(tmp_path):
    rewards, history = _rewards(tmp_path, PPO())
    _assert_rises(rewards)
    assert history[-1]["critic/value_mean"] > history[0]["critic/value_mean"]  # the critic learned


@pytest.mark.slow
def test_dapo_reward_rises_on_the_embedded_task(tmp_path):
    rewards, history = _rewards(tmp_path, DAPO())
    _assert_rises(rewards)
    assert sum(m["filter/groups_dropped"] for m in history) > 0  # dynamic sampling was exercised
