import pytest
import torch
from gcore_example_plugin import BrevityReward, Echo, Reinforce

from gcore.testing import make_batch, make_sample, tiny_fit


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
    result = tiny_fit(steps=2, reward=BrevityReward(max_chars=16), algorithm=Reinforce())
    assert len(result.history) == 2
    for metrics in result.history:
        # the brevity reward scored the samples: a response of t tokens has at most t characters, so its
        # reward is at least 1 - t/16 (the default target_char reward of a random policy is near 0)
        assert 1 - metrics["response_length/mean"] / 16 <= metrics["reward/mean"] <= 1
        # REINFORCE trained: its loss reports no clipped ratio, unlike GRPO's
        assert metrics["samples/trained"] > 0 and "clip_frac" not in metrics and "ratio" not in metrics


def test_echo_rewards_a_repeated_answer():
    env = Echo()
    state = env.reset(make_sample("?=", "", answer="7").prompt)
    assert env.step(state, "abc").observation == "|7="
    last = env.step(state, "77")
    assert last.done and last.reward == 1.0
