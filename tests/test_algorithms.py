"""Formulas against values computed by hand or in float64 reference code."""

import math

import pytest
import torch

from gcore.algorithms.base import LossScale, aggregate, clipped_surrogate, group_normalize, kl_estimate
from gcore.algorithms.grpo import GRPO
from gcore.types import RolloutBatch


def test_group_normalize_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_normalize(rewards, groups, scale=True, eps=0.0)
    # group 0: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # group 1: mean 3, unbiased std sqrt(2)
    assert adv[4:].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    centered = group_normalize(rewards, groups, scale=False)
    assert centered.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0])


def test_group_normalize_uniform_group_and_single_sample():
    adv = group_normalize(torch.tensor([3.0, 3.0, 5.0]), torch.tensor([7, 7, 9]), scale=True)
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    x = logp - ref  # [0.5, -1.0]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    expected = [math.exp(-v) - 1 + v for v in x.tolist()]
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(expected)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        kl_estimate(logp, ref, "k9")


def test_k3_is_unbiased_estimate_of_kl():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(5, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(5, dtype=torch.float64), 0)
    exact = (p * (p / q).log()).sum()
    draws = torch.multinomial(p, 200_000, replacement=True)
    estimate = kl_estimate(p.log()[draws], q.log()[draws], "k3").mean()
    assert float(estimate) == pytest.approx(float(exact), rel=0.03)


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    scale = LossScale(tokens=4, sequences=2, max_length=3)
    assert float(aggregate(loss, mask, scale, "token_mean")) == pytest.approx(10 / 4)
    assert float(aggregate(loss, mask, scale, "seq_mean_token_mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(loss, mask, scale, "seq_mean_token_sum_norm")) == pytest.approx(10 / 6)


def test_micro_batch_shares_add_up_to_the_batch_loss():
    torch.manual_seed(1)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        scale = LossScale(tokens=float(mask.sum()), sequences=6, max_length=5)
        whole = aggregate(loss, mask, scale, mode)
        parts = aggregate(loss[:2], mask[:2], scale, mode) + aggregate(loss[2:], mask[2:], scale, mode)
        assert float(parts) == pytest.approx(float(whole), abs=1e-6)


def test_clipped_surrogate_by_hand():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped, ratio = clipped_surrogate(logp, old, adv, 0.2, 0.2)
    # A>0: min(r, clip(r)) -> 1.2 (clipped) and 0.5; A<0: max(r, clip(r)) -> 1.1 and 0.8 (clipped)
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 1.1, 0.8])
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert ratio.tolist() == pytest.approx([1.5, 0.5, 1.1, 0.7])


def _batch(rewards, groups, length=4):
    b = len(rewards)
    return RolloutBatch(
        input_ids=torch.zeros(b, length, dtype=torch.long),
        attention_mask=torch.ones(b, length, dtype=torch.long),
        response_mask=torch.ones(b, length - 1),
        rewards=torch.tensor(rewards),
        group_ids=torch.tensor(groups),
        engine_logprobs=torch.zeros(b, length - 1),
    )


def test_grpo_loss_and_gradient_by_hand():
    algo = GRPO(loss_agg="token_mean")
    batch = _batch([1.0, 0.0], [0, 0])
    batch.advantages = algo.advantages(batch)  # std of (1, 0) is sqrt(0.5): advantages +-0.7071
    assert batch.advantages.tolist() == pytest.approx([0.70710, -0.70710], abs=1e-4)
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, shares = algo.loss(logp, batch, LossScale(tokens=6, sequences=2, max_length=3))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # on-policy: ratio 1, advantages cancel
    loss.backward()
    # d loss / d logp = -A / tokens for every token
    assert logp.grad[0].tolist() == pytest.approx([-0.70710 / 6] * 3, abs=1e-5)
    assert logp.grad[1].tolist() == pytest.approx([0.70710 / 6] * 3, abs=1e-5)
    assert float(shares["clip_frac"]) == 0.0


def test_grpo_kl_term_is_added_with_its_coefficient():
    algo = GRPO(kl_coef=0.5, kl_estimator="k1", loss_agg="token_mean")
    batch = _batch([1.0, 1.0], [0, 0])
    batch.advantages = algo.advantages(batch)  # uniform group: zero advantages
    batch.ref_logprobs = torch.full((2, 3), -2.0)
    logp = torch.full((2, 3), -1.0)
    loss, shares = algo.loss(logp, batch, LossScale(tokens=6, sequences=2, max_length=3))
    assert float(loss) == pytest.approx(0.5 * 1.0)
    assert float(shares["kl"]) == pytest.approx(1.0)
    assert algo.needs_reference and not GRPO().needs_reference
