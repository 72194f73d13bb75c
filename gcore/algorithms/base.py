"""The ``Algorithm`` contract and the formulas shared by its implementations."""

from __future__ import annotations

import functools
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from gcore.algorithms.mismatch import (
    DEFAULT_BOUNDS,
    MismatchCorrection,
    abs_log_ratio_max,
    bounds_error,
    correction_weight,
)
from gcore.errors import AlgorithmError, ConfigError
from gcore.types import RolloutBatch, Sample
from gcore.user_code import describe, ending_as

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass
class LossScale:
    """Global denominators of one mini-batch, summed over all its micro-batches and all ranks.

    Dividing each micro-batch's sums by these makes the micro-batch losses add up exactly to the
    mini-batch loss, whatever the micro-batch size and the number of ranks.
    """

    tokens: float  # response tokens
    sequences: float  # sequences
    max_length: float  # the generation budget (max_new_tokens), for the length-unbiased variant


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, scale: LossScale, mode: LossAggregation) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    - ``token_mean``: every response token of the mini-batch weighs the same (DAPO).
    - ``seq_mean_token_mean``: mean over tokens per sequence, then over sequences (GRPO paper);
      ``scale.sequences`` counts every row, also one with no loss token (it adds 0: docs/algorithms.md).
    - ``seq_mean_token_sum_norm``: token sums divided by a constant budget (Dr. GRPO).
    """
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / max(scale.tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(scale.sequences, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / max(scale.sequences * scale.max_length, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; "
                     "valid: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":  # unbiased and always >= 0: exp(-x) - 1 + x with x = log(pi / ref)
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: k1, k2, k3")


def group_normalize(rewards: torch.Tensor, group_ids: torch.Tensor, scale: bool, eps: float = 1e-6) -> torch.Tensor:
    """Reward minus its group's mean, divided by the group's (unbiased) std when ``scale``."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    rewards = rewards.double()
    sums = torch.zeros(len(counts), dtype=torch.double).index_add_(0, inverse, rewards)
    means = sums / counts
    centered = rewards - means[inverse]
    # a group whose rewards are all equal gets exactly 0 (its float mean may differ from them by an ulp)
    highs = torch.full((len(counts),), -torch.inf, dtype=torch.double).scatter_reduce(0, inverse, rewards, "amax")
    lows = torch.full((len(counts),), torch.inf, dtype=torch.double).scatter_reduce(0, inverse, rewards, "amin")
    centered = torch.where((highs == lows)[inverse], torch.zeros_like(centered), centered)
    if not scale:
        return centered.float()
    squares = torch.zeros(len(counts), dtype=torch.double).index_add_(0, inverse, centered.pow(2))
    std = torch.where(counts > 1, (squares / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(squares))
    return (centered / (std[inverse] + eps)).float()


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries (population std), as PPO normalises advantages."""
    values64, mask64 = values.double(), mask.double()
    count = mask64.sum().clamp(min=1.0)
    mean = (values64 * mask64).sum() / count
    var = ((values64 - mean).pow(2) * mask64).sum() / count
    whitened = (values64 - mean) / (var.sqrt() + eps)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * mask64).to(values.dtype)


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the response tokens of each row; returns (advantages, returns).

    ``mask`` marks the tokens the model generated. The state after the last one is terminal (value
    0): ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where
    ``t+1`` is the row's next model token: the tokens of a multi-turn episode's observations (mask 0
    between model turns) are skipped, not terminal. The returns are ``A_t + V_t``.
    """
    rewards64, values64, mask64 = token_rewards.double(), values.double() * mask.double(), mask.double()
    advantages = torch.zeros_like(values64)
    next_value = torch.zeros(values64.shape[0], dtype=torch.double)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(values64.shape[1])):
        delta = rewards64[:, t] + gamma * next_value - values64[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask64[:, t]
        model = mask64[:, t] > 0
        next_value = torch.where(model, values64[:, t], next_value)
        next_advantage = torch.where(model, advantages[:, t], next_advantage)
    returns = (advantages + values64) * mask64
    return advantages.to(values.dtype), returns.to(values.dtype)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per token, ``0.5 * max((V - R)^2, (V_old + clip(V - V_old) - R)^2)``.

    ``clip`` of ``None`` gives the plain squared error. Returns (loss, clipped indicator).
    """
    unclipped = (values - returns).pow(2)
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (clipped_values - returns).pow(2)
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer`` tokens, then linear down to
    ``-factor`` at ``max_length``, and ``-factor`` beyond it."""
    if buffer <= 0:
        return 0.0
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:
        return factor * (expected - length) / buffer
    return -factor


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped policy loss per token; returns (loss, clipped indicator, ratio)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float(), ratio


def dual_clip(loss: torch.Tensor, advantages: torch.Tensor, clip_ratio_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): where ``A < 0`` the clipped surrogate's loss
    ``max(-A r, -A clip(r))`` grows without bound with the ratio ``r``; bound it by ``-A * clip_ratio_c``
    (``c > 1``), with no gradient where the bound holds, as verl's ``compute_policy_loss``. Returns
    (the bounded loss, the indicator of the tokens it bounded)."""
    bound = -advantages * clip_ratio_c
    capped = (advantages < 0) & (loss > bound)
    return torch.where(capped, bound, loss), capped.float()


def check_clip_ratio_c(clip_ratio_c: float | None) -> None:
    """Refuse a dual-clip bound that is not above 1 (``None``: off)."""
    check(clip_ratio_c is None or clip_ratio_c > 1.0, f"--algorithm.clip_ratio_c must be > 1, got {clip_ratio_c}")


def behaviour_weight(
    proximal: torch.Tensor, behaviour: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour importance weight of each token, ``min(pi_prox / pi_behav, cap)``; returns (the
    truncated weight, the raw ratio), both without gradient.

    The decoupled PPO objective (AReaL, arXiv 2505.24298) for samples from an older policy
    ``pi_behav`` (the engine's log-probabilities): PPO's clipped surrogate is taken against the
    proximal policy ``pi_prox`` (the trainer's weights at the start of the step: ``old_logprobs``,
    or the current log-probabilities when the policy does not move within a step), and each token is
    weighed by ``pi_prox / pi_behav``, truncated at ``cap`` (truncated importance sampling, as
    verl's TIS) so that one unlikely token cannot dominate the update.
    """
    raw = torch.exp(proximal.detach() - behaviour.detach())
    return raw.clamp(max=cap), raw


#: the metrics ``Algorithm.loss`` gives as its micro-batch's maximum (not as a share of a token mean)
MAX_METRICS = frozenset({"mismatch/abs_log_ratio_max"})


def is_max_metric(name: str) -> bool:
    """Whether the metric ``name`` is a maximum (``MAX_METRICS``), which the backends reduce by ``max`` over
    micro-batches, ranks and optimizer steps; every other metric of ``loss`` is summed (token-mean shares)."""
    return name in MAX_METRICS


#: the methods of an algorithm gcore calls during a run, each guarded against code that ends the process
#: (``_guarded``): a subclass's override of any of them is wrapped when the subclass is defined
GUARDED_METHODS = ("setup", "loss_scale", "state_dict", "load_state_dict", "rows_to_train", "shape_reward",
                   "keep_group", "loss_mask", "advantages", "policy_loss", "value_loss", "loss")


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of an ``Algorithm`` whose ``SystemExit``, ``KeyboardInterrupt`` (its own, not a signal's)
    or other ``BaseException`` becomes an ``AlgorithmError`` naming the algorithm and the method: the run
    stops with one line (exit status 2 from the CLI), not with exit status 0 and nothing said. Ordinary
    exceptions pass through with their traceback."""

    @functools.wraps(method)
    def guarded(self: Algorithm, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401  as the method's
        def error(cause: BaseException) -> AlgorithmError:
            return AlgorithmError(f"algorithm {type(self).__name__}.{method.__name__} raised {describe(cause)}; an "
                                  f"algorithm's code must raise an exception, not end the process")

        with ending_as(error):
            return method(self, *args, **kwargs)

    guarded.__gcore_guarded__ = True  # type: ignore[attr-defined]
    return guarded


class Algorithm(ABC):
    """An RL algorithm: the parts a researcher changes are separate methods.

    - ``shape_reward``: turn a sample's raw reward into the training reward (default: unchanged).
    - ``keep_group``: whether a prompt's group of samples is trained on (default: yes).
    - ``loss_mask``: which response tokens count in the loss (default: all).
    - ``advantages``: per-sequence ``[B]`` or per-token ``[B, L-1]`` advantages of a batch.
    - ``policy_loss``: the per-token loss before aggregation.
    - ``value_loss``: the critic's per-token loss (only when ``needs_critic``).

    The options below are every algorithm's, declared here only. A subclass takes its own options,
    re-declares one of these only where it gives it another default or help text (the CLI's
    ``--algorithm.help`` shows the subclass's), and passes the rest on with ``**options``, by keyword:
    an option added here reaches every algorithm's CLI with no other edit. Off-policy samples
    (``--trainer.max_staleness`` >= 1): each token's loss is weighed by proximal / behaviour
    probability, truncated at ``behaviour_is_cap`` (``behaviour_weight``); no effect in the
    synchronous loop. ``mismatch_correction`` other than ``none`` replaces that weight, in the synchronous
    loop too, by a correction of the engine-vs-trainer ratio (``gcore/algorithms/mismatch.py``).

    Args:
        kl_coef: weight of KL(policy || reference); 0 disables the reference model.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (low-variance, non-negative).
        loss_agg: how per-token losses become one number (see ``aggregate``).
        epochs: passes over each step's batch.
        mini_batches: optimizer steps per pass (the batch is split into this many parts).
        entropy_coef: weight of the entropy bonus (subtracted from the loss); 0 disables it.
        behaviour_is_cap: cap of the behaviour importance weight for off-policy samples
            (``--trainer.max_staleness`` >= 1; see ``behaviour_weight``).
        mismatch_correction: the training-inference mismatch correction of the engine-vs-trainer ratio
            ``pi_prox / pi_engine``: ``none`` (only ``behaviour_is_cap`` off-policy), ``token_truncate`` (TIS),
            ``token_mask`` (MIS), ``sequence_truncate``, ``sequence_mask`` or ``geometric_mask``.
        mismatch_low: lower bound of the ratio (default: none; ``geometric_mask``: 0.999).
        mismatch_high: upper bound of the ratio (default 2.0; ``geometric_mask``: 1.001).
    """

    #: generation rounds a controller may run per step to fill its share of the batch after
    #: ``keep_group`` dropped groups (dynamic sampling); 1 means no re-sampling.
    max_rounds: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:  # noqa: ANN401  as object.__init_subclass__
        super().__init_subclass__(**kwargs)
        for name in GUARDED_METHODS:
            method = cls.__dict__.get(name)
            if isinstance(method, types.FunctionType) and not getattr(method, "__gcore_guarded__", False):
                setattr(cls, name, _guarded(method))

    def __init__(
        self,
        *,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        loss_agg: LossAggregation = "seq_mean_token_mean",
        epochs: int = 1,
        mini_batches: int = 1,
        entropy_coef: float = 0.0,
        behaviour_is_cap: float = 2.0,
        mismatch_correction: MismatchCorrection = "none",
        mismatch_low: float | None = None,
        mismatch_high: float | None = None,
    ) -> None:
        check(epochs >= 1 and mini_batches >= 1, f"epochs and mini_batches must be >= 1, got {epochs}, {mini_batches}")
        check_choice("kl_estimator", kl_estimator, KLEstimator)
        check_choice("loss_agg", loss_agg, LossAggregation)
        check(kl_coef >= 0, f"--algorithm.kl_coef must be >= 0, got {kl_coef}")
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.loss_agg = loss_agg
        self.epochs = epochs
        self.mini_batches = mini_batches
        self.entropy_coef = entropy_coef
        check(behaviour_is_cap >= 1.0, f"--algorithm.behaviour_is_cap must be >= 1, got {behaviour_is_cap}")
        self.behaviour_is_cap = behaviour_is_cap
        check_choice("mismatch_correction", mismatch_correction, MismatchCorrection)
        error = bounds_error(mismatch_correction, mismatch_low, mismatch_high)
        check(error is None, str(error))
        default_low, default_high = DEFAULT_BOUNDS.get(mismatch_correction, (None, 2.0))
        self.mismatch_correction = mismatch_correction
        self.mismatch_low, self.mismatch_high = mismatch_low, mismatch_high
        #: the bounds in force: the given ones, else the mode's defaults (``DEFAULT_BOUNDS``)
        self.mismatch_bounds = (default_low if mismatch_low is None else mismatch_low,
                                default_high if mismatch_high is None else mismatch_high)
        low, high = self.mismatch_bounds
        check(low is None or low < high, f"--algorithm.mismatch_low ({low}) must be below mismatch_high ({high})")
        self.max_new_tokens: int | None = None

    def setup(self, max_new_tokens: int) -> None:
        """Called once before training with the generation budget (for length-aware shaping and the
        ``seq_mean_token_sum_norm`` loss: ``loss_scale``); the only route by which it reaches the algorithm."""
        self.max_new_tokens = max_new_tokens

    def loss_scale(self, tokens: float, sequences: float) -> LossScale:
        """The denominators of one mini-batch: its response tokens and sequences, counted by the backend
        over every micro-batch and rank, with the generation budget given to ``setup``."""
        if self.max_new_tokens is None:
            raise RuntimeError(f"{type(self).__name__}.setup(max_new_tokens) must be called before training")
        return LossScale(tokens=tokens, sequences=sequences, max_length=float(self.max_new_tokens))

    def state_dict(self) -> dict:
        """State that changes during training (e.g. an adaptive KL coefficient), saved in every
        checkpoint as JSON; the built-in algorithms have none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned, when a run resumes."""

    @property
    def needs_reference(self) -> bool:
        """Whether reference-model log-probabilities must be computed (and the model kept)."""
        return self.kl_coef != 0.0

    @property
    def teacher_path(self) -> str | None:
        """The checkpoint directory of a frozen teacher whose per-token log-probabilities the backend computes
        (``RolloutBatch.teacher_logprobs``) before ``advantages``; ``None`` (default): no teacher."""
        return None

    @property
    def needs_critic(self) -> bool:
        """Whether the backend must build and train a critic (value model)."""
        return False

    @property
    def kl_in_loss(self) -> bool:
        """Whether the KL penalty is a loss term (else the algorithm puts it in the rewards)."""
        return True

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the policy changes within a step, so old log-probabilities must be kept."""
        return self.epochs > 1 or self.mini_batches > 1

    @property
    def zero_advantage_is_inert(self) -> bool:
        """Whether ``policy_loss`` is exactly zero, with a zero gradient, wherever the advantage is zero
        (true of the clipped surrogate ``max(-A r, -A clip(r))``). Default: no."""
        return False

    def rows_to_train(self, batch: RolloutBatch) -> torch.Tensor:
        """Which rows ``[B]`` (bool) the backend must run forward and backward.

        Default: every row, except that when a zero advantage makes a row's loss and gradient exactly
        zero (``zero_advantage_is_inert``, no critic, no KL term in the loss, no entropy bonus), the
        rows whose advantages are all zero are left out: with outcome rewards these are the groups
        whose samples all scored the same. The loss's denominators still count them, so the update is
        the same as with every row; only the work is less.
        """
        every = torch.ones(len(batch), dtype=torch.bool)
        if (batch.advantages is None or not self.zero_advantage_is_inert or self.needs_critic or self.entropy_coef
                or (self.needs_reference and self.kl_in_loss)):
            return every
        advantages = batch.advantages.reshape(len(batch), -1)
        return (advantages != 0).any(-1)

    def shape_reward(self, sample: Sample) -> float:
        return sample.reward

    def keep_group(self, rewards: torch.Tensor) -> bool:
        return True

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """Which tokens count in the loss ``[B, L-1]`` (default: every response token)."""
        return batch.response_mask

    @abstractmethod
    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """Advantages for every row of the batch: ``[B]`` or ``[B, L-1]``."""

    @abstractmethod
    def policy_loss(self, logprobs: torch.Tensor, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss ``[B, L-1]`` and per-token diagnostics to log (same shape)."""

    def value_loss(
        self, values: torch.Tensor, batch: RolloutBatch, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critic's share of its loss on this micro-batch, and its token-mean metrics."""
        raise NotImplementedError(f"{type(self).__name__} has no critic (needs_critic is False)")

    def loss(
        self,
        logprobs: torch.Tensor,
        batch: RolloutBatch,
        scale: LossScale,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the loss, and its share of each token-mean metric."""
        per_token, diagnostics = self.policy_loss(logprobs, batch)
        mask = batch.response_mask
        # how far the engine's distribution was from the one trained: its precision (a bfloat16 engine, another
        # kernel) and, off-policy, the samples' staleness
        diagnostics = {**diagnostics, "rollout/logprob_diff": (logprobs.detach() - batch.engine_logprobs).abs()}
        if batch.logprob_gaps is not None and batch.row_ids is not None:  # per sample, for rollout tracing
            batch.logprob_gaps.append((batch.row_ids, sample_gap(logprobs, batch)))
        per_token, corrections = self.correct_mismatch(per_token, logprobs, batch)
        diagnostics = {**diagnostics, **corrections}
        # the largest |log ratio| (a max, not a token mean): from the ratio the correction used
        abs_log_ratio = corrections["mismatch/abs_log_ratio_mean"]
        if self.needs_reference and self.kl_in_loss:
            if batch.ref_logprobs is None:
                raise RuntimeError("kl_coef is set but the batch has no reference log-probabilities")
            kl = kl_estimate(logprobs, batch.ref_logprobs, self.kl_estimator)
            per_token = per_token + self.kl_coef * kl
            diagnostics = {**diagnostics, "kl": kl}
        if self.entropy_coef and entropy is not None:
            per_token = per_token - self.entropy_coef * entropy
        loss = aggregate(per_token, mask, scale, self.loss_agg)
        shares = {name: (value.detach() * mask).sum() / max(scale.tokens, 1.0) for name, value in diagnostics.items()}
        shares["mismatch/abs_log_ratio_max"] = abs_log_ratio_max(abs_log_ratio, mask)
        return loss, shares

    @staticmethod
    def _engine_logprobs(batch: RolloutBatch) -> torch.Tensor:
        """The log-probabilities the engine sampled with: the behaviour policy's off-policy, else the engine's."""
        return batch.behaviour_logprobs if batch.behaviour_logprobs is not None else batch.engine_logprobs

    def correct_mismatch(
        self, per_token: torch.Tensor, logprobs: torch.Tensor, batch: RolloutBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss weighed by the engine-vs-trainer correction, and its per-token diagnostics.

        The ratio is ``pi_prox / pi_engine``: the trainer's log-probabilities at the start of the update (the
        proximal ones, as ``behaviour_weight``'s) against the engine's sampling ones. With ``mismatch_correction``
        ``none`` off-policy samples get ``behaviour_weight`` (truncated at ``behaviour_is_cap``) and on-policy ones
        no weight, as before; any other mode weighs every sample (``gcore/algorithms/mismatch.py``).
        """
        proximal = trainer_logprobs(logprobs, batch)
        log_ratio = proximal - self._engine_logprobs(batch).detach()
        diagnostics = {"mismatch/abs_log_ratio_mean": log_ratio.abs()}
        if self.mismatch_correction != "none":
            weight, corrected = correction_weight(log_ratio, batch.response_mask, self.mismatch_correction,
                                                  *self.mismatch_bounds)
            per_token = per_token * weight
        elif batch.behaviour_logprobs is not None:  # off-policy samples: the decoupled objective
            weight, raw = behaviour_weight(proximal, batch.behaviour_logprobs, self.behaviour_is_cap)
            per_token = per_token * weight
            corrected = (raw > self.behaviour_is_cap).float()
        else:
            corrected = torch.zeros_like(log_ratio)
        diagnostics["mismatch/masked_frac"] = corrected
        if batch.behaviour_logprobs is not None:
            diagnostics["async/behaviour_ratio_dev"] = (torch.exp(log_ratio) - 1.0).abs()
            diagnostics["async/behaviour_truncated_frac"] = corrected
        return per_token, diagnostics


def trainer_logprobs(logprobs: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """The trainer's log-probabilities that the engine's are measured against (detached): the step's old ones (the
    policy before this step's updates, the proximal policy) where the algorithm has them, else this forward's."""
    return (batch.old_logprobs if batch.old_logprobs is not None else logprobs).detach()


def sample_gap(logprobs: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """``[B]``: each row's mean |trainer - engine| log-probability over its response tokens (NaN for a row
    without any). The trainer's are the step's old log-probabilities where the algorithm has them (the policy
    before this step's updates), else those of this forward pass."""
    trainer = trainer_logprobs(logprobs, batch)
    mask = (batch.response_mask > 0).to(trainer.dtype)
    total = ((trainer - batch.engine_logprobs).abs() * mask).sum(-1)
    return (total / mask.sum(-1)).detach()  # 0 / 0: NaN


def check(ok: bool, message: str) -> None:
    """Raise a one-line ``ConfigError`` with ``message`` unless ``ok`` (the options' checks)."""
    if not ok:
        raise ConfigError(message)


def check_choice(name: str, value: str, choices: object) -> None:
    """Refuse ``--algorithm.<name> value`` unless ``value`` is one of the ``Literal`` ``choices``."""
    valid = get_args(choices)
    check(value in valid, f"--algorithm.{name} {value!r}: valid choices: {', '.join(valid)}")


def token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages ``[B]`` to tokens ``[B, L-1]``."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages
