"""The reward rises on the embedded default task."""

import pytest

from gcore import Trainer, TrainerConfig


@pytest.mark.slow
def test_grpo_reward_rises_on_the_embedded_task(tmp_path):
    result = Trainer(trainer=TrainerConfig(max_steps=30, default_root_dir=str(tmp_path), enable_progress_bar=False)).fit()
    rewards = [m["reward/mean"] for m in result.history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > 3 * first and last - first > 0.1, rewards
