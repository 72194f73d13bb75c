import pytest
import torch

from gcore.testing import make_batch, make_sample, tiny_fit
from gcore_example_plugin import BrevityReward, Reinforce


def test_brevity_reward():
    reward = BrevityReward(max_chars=4)
    assert reward.score([make_sample("q", ""), make_sample("q", "ab"), make_sample("q", "abcdef")]) == [1.0, 0.5, 0.0]


def test_reinforce_gradient_is_minus_advantage():
    algo = Reinforce(loss_agg="token_mean")
    batch = make_batch([1.0, 0.0], [0, 0])
    batch.advantages = algo.advantages(batch)
    assert batch.advantages.tolist() == pytest.approx([0.5, -0.5])
    logprobs = torch.zeros(2, 3, requires_grad=True)
    from gcore import LossScale

    loss, _ = algo.loss(logprobs, batch, LossScale(tokens=4, sequences=2, max_length=3))
    loss.backward()
    assert logprobs.grad.flatten().tolist() == pytest.approx([0, -0.125, -0.125, 0, 0.125, 0.125])


def test_trains_inside_gcore():
    result = tiny_fit(steps=2, reward=BrevityReward(), algorithm=Reinforce())
    assert len(result.history) == 2 and result.history[-1]["reward/mean"] >= 0
