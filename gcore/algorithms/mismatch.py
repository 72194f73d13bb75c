"""Training-inference mismatch corrections: weights and masks from the engine-vs-trainer ratio.

The engine that samples (vLLM, sglang, the ``hf`` engine in bfloat16, another kernel) and the trainer give the
same tokens different log-probabilities. Each token's ratio is ``r_t = pi_prox(o_t) / pi_engine(o_t)``, with
``pi_prox`` the trainer's policy at the start of the update (``old_logprobs``, or the current log-probabilities
when the policy does not move within a step) and ``pi_engine`` the engine's sampling log-probability (the
behaviour policy of an off-policy sample). ``Algorithm.loss`` multiplies each token's policy loss by the weight
``correction_weight`` returns; the weight carries no gradient. docs/algorithms.md ("Training-inference
mismatch") describes each mode and compares it with TRL's and verl's.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

MismatchCorrection = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                             "geometric_mask"]

#: the bounds a mode takes when ``--algorithm.mismatch_low`` / ``mismatch_high`` are not given: ``low`` ``None`` is
#: no lower bound (TRL's ``vllm_importance_sampling_clip_min`` default); ``high`` 2.0 is verl's TIS cap and
#: gcore's ``behaviour_is_cap``; the geometric mean of the ratios is within 1e-3 of 1 unless the engine differs
DEFAULT_BOUNDS: dict[str, tuple[float | None, float]] = {
    "token_truncate": (None, 2.0), "token_mask": (None, 2.0), "sequence_truncate": (None, 2.0),
    "sequence_mask": (None, 2.0), "geometric_mask": (0.999, 1.001),
}


def bounds_error(mode: str, low: float | None, high: float | None) -> str | None:
    """Why ``--algorithm.mismatch_low low --algorithm.mismatch_high high`` cannot go with ``mode`` (``None``: they
    can). The interval must hold 1, the ratio of a token both sides agree on."""
    if mode == "none":
        if low is not None or high is not None:
            return ("--algorithm.mismatch_low/mismatch_high need a --algorithm.mismatch_correction; valid: "
                    f"{', '.join(DEFAULT_BOUNDS)}")
        return None
    if high is not None and not (math.isfinite(high) and high >= 1.0):
        return f"--algorithm.mismatch_high must be a finite number >= 1, got {high}"
    if low is not None and not (0.0 <= low <= 1.0):
        return f"--algorithm.mismatch_low must be in [0, 1], got {low}"
    return None


def correction_weight(
    log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, low: float | None, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's weight ``[B, T]`` under ``mode``, and the indicator of the tokens the correction truncated or
    masked (1.0 or 0.0); ``log_ratio`` is ``log pi_prox - log pi_engine`` per token, ``mask`` the response tokens.

    - ``token_truncate``: ``clamp(r_t, low, high)`` (truncated importance sampling, TIS).
    - ``token_mask``: ``r_t`` where ``low <= r_t <= high``, else 0 (masked importance sampling, MIS).
    - ``sequence_truncate``: every token of a row weighs ``clamp(prod_t r_t, low, high)``.
    - ``sequence_mask``: ``prod_t r_t`` where it is within the bounds, else 0 for the whole row.
    - ``geometric_mask``: 1 where the geometric mean ``exp(mean_t log r_t)`` is within the bounds, else 0 for the
      whole row (rejection only, no weight).

    Tokens off ``mask`` get weight 1 and are never counted as corrected (their loss is masked anyway). No lower
    bound (``low`` ``None``) truncates or masks nothing from below.
    """
    log_ratio = (log_ratio.detach() * mask).nan_to_num(0.0)
    floor = -math.inf if low is None else low
    if mode.startswith("token_"):
        ratio = torch.exp(log_ratio)
    elif mode.startswith("sequence_"):
        ratio = torch.exp(log_ratio.sum(-1, keepdim=True)).expand_as(log_ratio)
    elif mode == "geometric_mask":
        mean = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        ratio = torch.exp(mean).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown mismatch correction {mode!r}; valid: {', '.join(DEFAULT_BOUNDS)}")
    outside = ((ratio < floor) | (ratio > high)) & (mask > 0)
    if mode.endswith("_truncate"):
        weight = ratio.clamp(min=low, max=high)
    elif mode == "geometric_mask":
        weight = torch.ones_like(ratio)
    else:
        weight = ratio
    weight = torch.where(outside, torch.zeros_like(weight), weight) if mode.endswith("_mask") else weight
    weight = torch.where(mask > 0, weight, torch.ones_like(weight))
    return weight, outside.to(weight.dtype)


def abs_log_ratio_max(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest ``|log r_t|`` over the response tokens (0 when there is none)."""
    values = (log_ratio.detach().abs() * mask).nan_to_num(0.0)
    return values.max() if values.numel() else values.new_zeros(())
