"""Formulas against values computed by hand or in float64 reference code."""

import math

import pytest
import torch

from gcore.algorithms.base import (
    LossScale,
    aggregate,
    clipped_surrogate,
    clipped_value_loss,
    dual_clip,
    gae,
    group_normalize,
    kl_estimate,
    masked_whiten,
    overlong_penalty,
)
from gcore.algorithms.dapo import DAPO
from gcore.algorithms.grpo import GRPO
from gcore.algorithms.ppo import PPO, last_token_rewards
from gcore.algorithms.rloo import RLOO
from gcore.errors import ConfigError
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


def test_seq_mean_token_mean_counts_rows_without_loss_tokens():
    # a row with no loss token (DAPO's filter_truncated, or a controller's zero-weight placeholder) adds 0
    # to the sum but still counts in G, as the backends count every row of the mini-batch (docs/algorithms.md)
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    scale = LossScale(tokens=4, sequences=3, max_length=3)
    assert float(aggregate(loss, mask, scale, "seq_mean_token_mean")) == pytest.approx((2 + 4 + 0) / 3)
    assert float(aggregate(loss, mask, scale, "token_mean")) == pytest.approx(10 / 4)  # no weight at all there
    # the same through DAPO's overlong filter: the truncated row's loss is dropped, its row still counted
    algo = DAPO(filter_truncated=True, loss_agg="seq_mean_token_mean")
    batch = _batch([1.0, 0.0], [0, 0])
    batch.truncated = torch.tensor([True, False])
    batch.response_mask = algo.loss_mask(batch)  # as the controller does
    batch.advantages = torch.tensor([1.0, -1.0])
    logp = torch.zeros(2, 3)
    loss, _ = algo.loss(logp, batch, LossScale(tokens=3, sequences=2, max_length=3))
    assert float(loss) == pytest.approx((0.0 + 1.0) / 2)  # not 1.0: the masked row counts in G


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


def test_dual_clip_bounds_the_loss_of_negative_advantages_only():
    logp = torch.log(torch.tensor([10.0, 10.0, 1.1, 0.5])).requires_grad_()
    adv = torch.tensor([-1.0, 1.0, -2.0, -1.0])
    surrogate, _, _ = clipped_surrogate(logp, torch.zeros(4), adv, 0.2, 0.2)
    assert surrogate.tolist() == pytest.approx([10.0, -1.2, 2.2, 0.8])  # A<0: grows with the ratio
    loss, capped = dual_clip(surrogate, adv, 3.0)
    # verl: A<0 -> min(max(-A r, -A clip(r)), -A c); the bound -A c = 3, 6, 3 holds only for the first
    assert loss.tolist() == pytest.approx([3.0, -1.2, 2.2, 0.8])
    assert capped.tolist() == [1.0, 0.0, 0.0, 0.0]
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 2.2, 0.0])  # no gradient where bounded (or clipped)


@pytest.mark.parametrize("make", [
    lambda c: GRPO(clip_ratio_c=c), lambda c: DAPO(clip_ratio_c=c), lambda c: RLOO(clip_ratio_c=c, epochs=2),
    lambda c: PPO(clip_ratio_c=c),
])
def test_dual_clip_in_the_clipped_surrogate_algorithms(make):
    batch = _batch([1.0, 0.0], [0, 0], length=2)
    batch.advantages = torch.tensor([[-1.0], [1.0]])
    batch.old_logprobs = torch.zeros(2, 1)
    logp = torch.log(torch.tensor([[10.0], [10.0]]))
    off, off_diagnostics = make(None).policy_loss(logp, batch)
    on, diagnostics = make(3.0).policy_loss(logp, batch)
    upper = -(1 + make(None).clip_eps_high)  # A > 0: the upper clip (DAPO's clip_high 0.28)
    assert off.squeeze(-1).tolist() == pytest.approx([10.0, upper])  # off (the default): unbounded
    assert on.squeeze(-1).tolist() == pytest.approx([3.0, upper])  # the positive advantage is untouched
    assert diagnostics["clip_frac_lower"].squeeze(-1).tolist() == [1.0, 0.0]
    assert "clip_frac_lower" not in off_diagnostics and make(None).clip_ratio_c is None


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
    algo = GRPO(kl_coef=0.0, loss_agg="token_mean")
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
    assert algo.needs_reference and not GRPO(kl_coef=0.0).needs_reference
    assert GRPO().kl_coef == 0.0  # no KL by default (the paper's 0.04 is --algorithm.kl_coef 0.04)


# --- GAE, whitening, value loss, overlong shaping ------------------------------------------------


def _gae_reference(rewards, values, gamma, lam):
    """Textbook GAE on one response (python floats, float64)."""
    T = len(rewards)
    adv = [0.0] * T
    next_adv, next_value = 0.0, 0.0
    for t in reversed(range(T)):
        delta = rewards[t] + gamma * next_value - values[t]
        adv[t] = delta + gamma * lam * next_adv
        next_adv, next_value = adv[t], values[t]
    return adv, [a + v for a, v in zip(adv, values, strict=False)]


def test_gae_matches_float64_reference_on_ragged_responses():
    torch.manual_seed(3)
    mask = torch.zeros(3, 7)
    mask[0, 1:5] = 1  # response at positions 1..4, padding after
    mask[1, 3:7] = 1  # response up to the end
    mask[2, 0:2] = 1
    rewards = torch.randn(3, 7, dtype=torch.float64) * mask
    values = torch.randn(3, 7, dtype=torch.float64)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5), (0.99, 1.0)):
        adv, ret = gae(rewards, values, mask, gamma, lam)
        for row in range(3):
            cols = mask[row].nonzero().squeeze(-1).tolist()
            ref_adv, ref_ret = _gae_reference(rewards[row, cols].tolist(), values[row, cols].tolist(), gamma, lam)
            assert adv[row, cols].tolist() == pytest.approx(ref_adv, abs=1e-12)
            assert ret[row, cols].tolist() == pytest.approx(ref_ret, abs=1e-12)
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_gae_by_hand():
    # one response of 2 tokens, reward 1 at the end, values (0.5, 0.25), gamma 1, lambda 0.5
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 1.0, 0.5)
    # delta_1 = 1 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.5 * 0.75 = 0.125
    assert adv.flatten().tolist() == pytest.approx([0.125, 0.75])
    assert ret.flatten().tolist() == pytest.approx([0.625, 1.0])


def test_masked_whiten_by_hand():
    values = torch.tensor([[1.0, 3.0, 99.0], [5.0, 7.0, -99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = masked_whiten(values, mask, eps=0.0)
    # masked entries 1, 3, 5, 7: mean 4, population std sqrt(5)
    s = math.sqrt(5)
    assert out.flatten().tolist() == pytest.approx([-3 / s, -1 / s, 0.0, 1 / s, 3 / s, 0.0])


def test_clipped_value_loss_by_hand():
    values = torch.tensor([1.0, 1.0, 0.0, 0.45])
    old = torch.tensor([0.5, 0.5, 0.5, 0.5])
    returns = torch.tensor([2.0, 0.0, 0.0, 0.5])
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    # V moved to 1.0 (clipped: 0.7): errors (1.0, 0.49) vs returns 2 -> max 1.69; vs 0 -> max(1, 0.49) = 1
    # V moved to 0.0 (clipped: 0.3) vs 0 -> max(0, 0.09); V 0.45 inside the range -> plain 0.0025
    assert loss.tolist() == pytest.approx([0.5 * 1.69, 0.5 * 1.0, 0.5 * 0.09, 0.5 * 0.0025])
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0]
    plain, _ = clipped_value_loss(values, old, returns, clip=None)
    assert plain.tolist() == pytest.approx([0.5, 0.5, 0.0, 0.5 * 0.0025])


def test_overlong_penalty_by_hand():
    # limit 20, buffer 4: free up to 16 tokens, then -1/4 per token, -factor at and beyond the limit
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20, 25)] == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    )
    assert overlong_penalty(18, 20, 4, factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(20, 20, 0) == 0.0  # buffer 0: off


def test_dr_grpo_aggregation_is_length_unbiased():
    # the same per-token loss on a short and a long sequence: seq_mean_token_mean gives each sequence
    # the same weight (so short sequences' tokens weigh more); token_sum_norm weighs every token equally
    loss = torch.ones(2, 4)
    mask = torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 1, 1]])
    scale = LossScale(tokens=5, sequences=2, max_length=4)
    grad_weights = {}
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        x = loss.clone().requires_grad_(True)
        aggregate(x, mask, scale, mode).backward()
        grad_weights[mode] = (x.grad[0, 0].item(), x.grad[1, 0].item())
    assert grad_weights["token_mean"] == pytest.approx((1 / 5, 1 / 5))
    assert grad_weights["seq_mean_token_mean"] == pytest.approx((1 / 2, 1 / 8))
    assert grad_weights["seq_mean_token_sum_norm"] == pytest.approx((1 / 8, 1 / 8))


# --- PPO ------------------------------------------------------------------------------------------


def test_last_token_rewards():
    mask = torch.tensor([[0.0, 1, 1, 0], [1.0, 1, 1, 1], [0.0, 0, 0, 0]])
    out = last_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 2, 0], [0, 0, 0, 3], [0, 0, 0, 0]]


def test_ppo_kl_as_reward_term_and_advantages():
    algo = PPO(gamma=1.0, lam=1.0, kl_coef=0.5, kl_estimator="k1", whiten_advantages=False)
    batch = _batch([1.0], [0], length=4)
    batch.response_mask = torch.tensor([[0.0, 1.0, 1.0]])
    batch.engine_logprobs = torch.tensor([[0.0, -1.0, -1.0]])
    batch.ref_logprobs = torch.tensor([[0.0, -1.5, -0.5]])  # k1 = (0.5, -0.5)
    batch.values = torch.tensor([[0.0, 0.2, 0.4]])
    rewards = algo.token_rewards(batch)
    assert rewards.flatten().tolist() == pytest.approx([0.0, -0.25, 1.25])
    adv = algo.advantages(batch)
    # gamma = lambda = 1: A_t = sum of rewards from t on - V_t
    assert adv.flatten().tolist() == pytest.approx([0.0, 1.0 - 0.2, 1.25 - 0.4])
    assert batch.returns.flatten().tolist() == pytest.approx([0.0, 1.0, 1.25])
    assert not algo.kl_in_loss and PPO(kl_penalty="loss").kl_in_loss
    assert algo.needs_critic and algo.needs_reference and not PPO(kl_coef=0).needs_reference


def test_ppo_loss_clips_policy_and_adds_entropy_bonus():
    algo = PPO(kl_coef=0.0, clip_eps=0.2, entropy_coef=0.1, loss_agg="token_mean")
    batch = _batch([0.0, 0.0], [0, 1], length=2)
    batch.advantages = torch.tensor([[1.0], [-1.0]])
    batch.old_logprobs = torch.zeros(2, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5]]))
    entropy = torch.tensor([[2.0], [4.0]])
    loss, shares = algo.loss(logp, batch, LossScale(tokens=2, sequences=2, max_length=1), entropy)
    # A=+1, r=1.5 -> -1.2 (clipped); A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped); entropy -0.1*(2+4)
    assert float(loss) == pytest.approx((-1.2 + 0.8 - 0.6) / 2)
    assert float(shares["clip_frac"]) == pytest.approx(1.0)


def test_ppo_value_loss_shares():
    algo = PPO(value_clip=None, loss_agg="token_mean")
    batch = _batch([0.0], [0], length=3)
    batch.values = torch.zeros(1, 2)
    batch.returns = torch.tensor([[1.0, 3.0]])
    loss, shares = algo.value_loss(torch.tensor([[0.0, 1.0]]), batch, LossScale(tokens=2, sequences=1, max_length=2))
    assert float(loss) == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert float(shares["critic/value_loss"]) == pytest.approx(1.25)


# --- DAPO, RLOO, options ------------------------------------------------------------------------


def test_dapo_decoupled_clip_keep_group_and_shaping():
    algo = DAPO(clip_low=0.2, clip_high=0.28, overlong_buffer=4)
    algo.setup(max_new_tokens=16)
    batch = _batch([1.0, 0.0], [0, 0], length=2)
    batch.advantages = torch.tensor([1.0, -1.0])
    logp = torch.log(torch.tensor([[1.5], [0.5]]))
    batch.old_logprobs = torch.zeros(2, 1)
    per_token, _ = algo.policy_loss(logp, batch)
    assert per_token.squeeze(-1).tolist() == pytest.approx([-1.28, 0.8])  # upper clip 1.28, lower 0.8
    assert algo.loss_agg == "token_mean" and not algo.needs_reference
    assert algo.keep_group(torch.tensor([0.0, 1.0])) and not algo.keep_group(torch.tensor([0.5, 0.5]))
    assert DAPO(dynamic_sampling=False).keep_group(torch.tensor([0.5, 0.5]))
    from gcore.types import Prompt, Sample

    def sample(length):
        return Sample(Prompt(0, "1=", [1]), 0, [5] * length, [0.0] * length, "", finished=False, reward=1.0)

    assert [algo.shape_reward(sample(n)) for n in (12, 14, 16)] == pytest.approx([1.0, 0.5, 0.0])


def test_dapo_filters_truncated_samples_from_the_loss():
    batch = _batch([1.0, 0.0], [0, 0])
    batch.truncated = torch.tensor([True, False])
    assert DAPO(filter_truncated=True).loss_mask(batch).sum(-1).tolist() == [0.0, 3.0]
    assert DAPO().loss_mask(batch).sum(-1).tolist() == [3.0, 3.0]


def test_rloo_leave_one_out_advantages():
    batch = _batch([1.0, 0.0, 0.0, 2.0, 4.0, 7.0], [0, 0, 0, 1, 1, 2])
    adv = RLOO().advantages(batch)
    # sample 0: 1 - mean(0, 0) = 1; sample 1: 0 - mean(1, 0) = -0.5; group 1: 2 - 4, 4 - 2; a lone sample: 0
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5, -2.0, 2.0, 0.0])


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: GRPO(loss_agg="mean"), r"--algorithm.loss_agg 'mean': valid choices: token_mean"),
        (lambda: GRPO(kl_estimator="k4"), r"--algorithm.kl_estimator 'k4': valid choices: k1, k2, k3"),
        (lambda: PPO(kl_penalty="both"), r"--algorithm.kl_penalty 'both': valid choices: reward, loss"),
        (lambda: PPO(lam=1.5), r"gamma and lam must be in \[0, 1\]"),
        (lambda: DAPO(max_rounds=0), r"max_rounds must be >= 1"),
        (lambda: GRPO(epochs=0), r"epochs and mini_batches must be >= 1"),
        (lambda: GRPO(clip_ratio_c=1.0), r"^--algorithm.clip_ratio_c must be > 1, got 1.0$"),
        (lambda: DAPO(clip_ratio_c=0.5), r"^--algorithm.clip_ratio_c must be > 1, got 0.5$"),
        (lambda: PPO(clip_ratio_c=-3.0), r"^--algorithm.clip_ratio_c must be > 1, got -3.0$"),
    ],
)
def test_bad_options_fail_with_one_line(build, message):
    with pytest.raises(ConfigError, match=message) as caught:
        build()
    assert "\n" not in str(caught.value)


def test_dapo_buffer_must_fit_the_budget():
    with pytest.raises(ConfigError, match="overlong_buffer 16 must be < --sampling.max_new_tokens 16"):
        DAPO(overlong_buffer=16).setup(16)


def test_cli_choice_of_algorithm_gets_its_own_defaults():
    # jsonargparse would carry the default class's values (GRPO's epochs 1) over to another class
    from gcore import cli

    parser = cli.build_fit_parser()
    for argv, expected in [
        (["--algorithm", "ppo"], ("PPO", 0.0, 2)),
        (["--algorithm.kl_coef", "0.2", "--algorithm", "ppo"], ("PPO", 0.2, 2)),
        (["--algorithm.epochs", "3"], ("GRPO", 0.0, 3)),
    ]:
        config = parser.parse_args(cli.with_default_plugins(cli.resolve_argv(argv)))
        init = parser.instantiate_classes(config)["algorithm"]
        assert (type(init).__name__, init.kl_coef, init.epochs) == expected, argv


def test_the_generation_budget_reaches_the_loss_through_setup_only():
    algo = GRPO(loss_agg="seq_mean_token_sum_norm")
    with pytest.raises(RuntimeError, match=r"GRPO.setup\(max_new_tokens\) must be called"):
        algo.loss_scale(tokens=6, sequences=2)
    algo.setup(max_new_tokens=7)
    assert algo.loss_scale(tokens=6, sequences=2) == LossScale(tokens=6, sequences=2, max_length=7.0)
