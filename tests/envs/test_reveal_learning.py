"""The tiny default model learns the embedded multi-turn task: it must use what the environment reveals.

``--data.task reveal --env reveal``: the prompt ``?=`` hides a digit, the environment shows it after the
model's first turn, and the second turn scores the share of its 8 characters equal to it. A policy that
ignores the observation can at best repeat one digit always: 0.1 on average. Measured on the 2-core CPU
(2026-11-26, 40 steps, last-10 mean reward per seed, next to other work):

- with the digit revealed: seeds 0, 1, 2: 0.304, 0.186, 0.360 (first-10: 0.031, 0.027, 0.016);
- the same with an observation that shows ``?`` instead of the digit: 0.107, 0.114, 0.094.

Later runs spread wider (2026-11-26, fresh clones, the suite's other process beside them): seeds 0, 1, 2:
0.156, 0.107, 0.202 (mean 0.155); seed 1 alone twice more: 0.125 and 0.166. So the test asks the 3-seed mean of
the last 10 steps to exceed ``MIN_MEAN`` (0.135: between the hidden-digit mean 0.105, whose seeds never passed
0.114, and the lowest revealed mean measured, 0.155) and every seed to gain at least ``MIN_RATIO`` times its
first 10 steps' mean (measured ratios 4-22).
"""

import pytest

from gcore import Trainer, TrainerConfig
from gcore.data import DataConfig
from gcore.envs.reveal import RevealEnvironment
from gcore.types import SamplingParams

SEEDS = (0, 1, 2)
MIN_MEAN = 0.135
MIN_RATIO = 3.0
pytestmark = pytest.mark.timeout(1800)


@pytest.mark.slow
def test_the_policy_learns_to_use_the_revealed_digit(tmp_path):
    firsts, lasts = [], []
    for seed in SEEDS:
        result = Trainer(
            trainer=TrainerConfig(max_steps=40, seed=seed, default_root_dir=str(tmp_path / str(seed)),
                                  enable_progress_bar=False, save_final=False),
            data=DataConfig(task="reveal"), sampling=SamplingParams(max_new_tokens=8), env=RevealEnvironment(),
        ).fit()
        rewards = [m["reward/mean"] for m in result.history]
        assert all(m["env/turns_mean"] == 2.0 for m in result.history)
        firsts.append(sum(rewards[:10]) / 10)
        lasts.append(sum(rewards[-10:]) / 10)
    summary = [f"{f:.3f} -> {last:.3f}" for f, last in zip(firsts, lasts, strict=True)]
    print("first-10 -> last-10 mean reward per seed:", summary)
    assert all(last > MIN_RATIO * first for first, last in zip(firsts, lasts, strict=True)), summary
    assert sum(lasts) / len(lasts) > MIN_MEAN, summary
