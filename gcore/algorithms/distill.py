"""On-policy distillation: a teacher's per-token log-probabilities as the advantage (reverse KL to the teacher).

The student samples; a frozen teacher (any local checkpoint with the student's tokenizer) scores every sampled
token; the per-token advantage is ``-(log pi_student(t) - log pi_teacher(t))``, the negative of the one-sample
estimate of the reverse KL ``KL(student || teacher)`` at that token, trained with GRPO's clipped surrogate
(Thinking Machines' "On-Policy Distillation"; the recipe verl, slime and NeMo-RL ship under that name). It can be
added to a reward's group-normalised advantage with weights (``reward_weight``, ``teacher_weight``).

The teacher's log-probabilities are computed by the training backend as a second frozen model, like the reference
model, loaded from ``--algorithm.teacher``; or, with ``--algorithm.teacher_engine hf``, by an engine of its own that
the placement policy places like a generative judge (``TeacherScoring``), and they travel with the samples
(``Sample.teacher_logprobs``) to the loss (docs/algorithms.md, "On-policy distillation").
"""

from __future__ import annotations

import os
from typing import Any

import torch

from gcore.algorithms.base import KLEstimator, LossAggregation, check, group_normalize
from gcore.algorithms.grpo import GRPO
from gcore.engines.base import Engine, scores_tokens
from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.rewards.base import RewardModel
from gcore.types import RolloutBatch


def reverse_kl_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]``: ``-(log pi_student(t) - log pi_teacher(t))`` at each sampled response token, 0 elsewhere."""
    return -(student - teacher) * mask


class Distill(GRPO):
    """On-policy distillation (reverse KL to a teacher), alone or added to a reward's advantage.

    Each response token ``t`` gets the advantage
    ``teacher_weight * -(log pi_student(t) - log pi_teacher(t)) + reward_weight * A_reward`` where ``A_reward``
    is GRPO's group-normalised reward advantage (the same for every token of a sample). The student's
    log-probabilities are those the sampler drew the tokens with (the engine's; the trainer's own when the
    algorithm computes them before the update, with ``epochs`` or ``mini_batches`` > 1); the teacher's are
    computed by the training backend at the sampling temperature. The loss is GRPO's clipped surrogate
    with these per-token advantages. Logs ``distill/reverse_kl``: the per-token estimate
    ``log pi_student - log pi_teacher`` under the policy being trained, averaged over response tokens.

    Args:
        teacher: the teacher, a local HF checkpoint directory whose tokenizer is the student's (required).
        teacher_engine: the engine that runs the teacher (``hf``), as a judge's engine runs: in the controller's
            process with ``--placement static``, on the engine workers (swapped in after generation) with
            ``--placement.workers``, on the judge partition with ``--placement dynamic``. Its per-token
            log-probabilities of each sample travel with the sample to the loss. Unset (default): the training
            backend loads the teacher as a second frozen model and computes them in PREPARE.
        teacher_weight: weight of the teacher's per-token advantage (> 0).
        reward_weight: weight of the reward's group-normalised advantage; 0 (default): distillation alone.
        clip_eps: clip range of the probability ratio (GRPO's).
        scale_rewards: divide the reward's advantage by its group's std (GRPO's; only with ``reward_weight``).
        kl_coef: weight of a KL term to the reference model in the loss (GRPO's; 0 by default).
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        loss_agg: how per-token losses become one number; ``token_mean`` by default (every sampled token's
            reverse KL weighs the same).
        **options: the other options of GRPO and ``Algorithm``, by keyword.
    """

    def __init__(
        self,
        *,
        teacher: str | None = None,
        teacher_engine: Engine | None = None,
        teacher_weight: float = 1.0,
        reward_weight: float = 0.0,
        clip_eps: float = 0.2,
        scale_rewards: bool = True,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        loss_agg: LossAggregation = "token_mean",
        **options: Any,  # noqa: ANN401  GRPO's and Algorithm's other arguments, checked there
    ) -> None:
        super().__init__(clip_eps=clip_eps, scale_rewards=scale_rewards, kl_coef=kl_coef, kl_estimator=kl_estimator,
                         loss_agg=loss_agg, **options)
        check(teacher is not None, "--algorithm.teacher is required by --algorithm distill: a local HF checkpoint "
                                   "directory (config.json and tokenizer) with the student's tokenizer")
        assert teacher is not None  # checked above
        check(os.path.isfile(os.path.join(teacher, "config.json")),
              f"--algorithm.teacher {teacher}: no HF checkpoint there (no config.json); give a local checkpoint "
              "directory with the student's tokenizer")
        check(teacher_weight > 0, f"--algorithm.teacher_weight must be > 0, got {teacher_weight}")
        check(reward_weight >= 0, f"--algorithm.reward_weight must be >= 0, got {reward_weight}")
        if teacher_engine is not None and not scores_tokens(teacher_engine):
            raise ConfigError(f"--algorithm.teacher_engine {type(teacher_engine).__name__}: this engine does not "
                              "score given tokens (Engine.token_logprobs), which the teacher needs; valid choices: "
                              f"{', '.join(scoring_engines())}, or no teacher_engine (the trainer's teacher)")
        self.teacher = teacher
        self.teacher_engine = teacher_engine
        self.teacher_weight = teacher_weight
        self.reward_weight = reward_weight

    @property
    def teacher_path(self) -> str | None:
        """The teacher the backend loads; ``None`` with ``teacher_engine`` (an engine scores the samples)."""
        return self.teacher if self.teacher_engine is None else None

    def teacher_scoring(self, reward: RewardModel, temperature: float) -> RewardModel:
        """``reward`` with the teacher engine's scoring added (``TeacherScoring``); ``reward`` itself without one."""
        if self.teacher_engine is None:
            return reward
        from gcore.algorithms.teacher_engine import TeacherScoring  # not imported before: no --reward choice

        assert self.teacher is not None  # required (checked in __init__)
        return TeacherScoring(reward, self.teacher_engine, ModelSource(self.teacher, torch.float32), temperature)

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        if batch.teacher_logprobs is None:
            raise RuntimeError("--algorithm distill: the batch has no teacher log-probabilities (the backend computes "
                               "them when the algorithm's teacher_path is set; the teacher engine with the samples "
                               "where the run's reward is TeacherScoring)")
        student = batch.old_logprobs if batch.old_logprobs is not None else self._engine_logprobs(batch)
        mask = batch.response_mask
        advantages = self.teacher_weight * reverse_kl_advantages(student, batch.teacher_logprobs, mask)
        if self.reward_weight:
            rewards = group_normalize(batch.rewards, batch.group_ids, self.scale_rewards)
            advantages = advantages + self.reward_weight * rewards.unsqueeze(-1) * mask
        return advantages

    def policy_loss(self, logprobs: torch.Tensor, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, diagnostics = super().policy_loss(logprobs, batch)
        assert batch.teacher_logprobs is not None  # ``advantages`` refused a batch without them
        diagnostics["distill/reverse_kl"] = logprobs.detach() - batch.teacher_logprobs
        return loss, diagnostics


def check_teacher_vocabulary(student: ModelSource, teacher: ModelSource) -> None:
    """Refuse (one line) a teacher whose tokenizer's vocabulary is not the student's: the teacher scores the
    student's token ids, which must mean the same tokens to both."""
    from transformers import AutoTokenizer

    def vocabulary(source: ModelSource, who: str) -> dict[str, int]:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=source.trust_remote_code)
        except (OSError, ValueError) as error:
            raise ConfigError(f"--algorithm.teacher {teacher.path}: cannot load the {who}'s tokenizer from "
                              f"{source.path} ({type(error).__name__}); the teacher needs the student's tokenizer "
                              "saved with it") from None
        return tokenizer.get_vocab()

    mine, theirs = vocabulary(student, "student"), vocabulary(teacher, "teacher")
    if mine != theirs:
        differ = sum(1 for token, index in theirs.items() if mine.get(token) != index) + len(set(mine) - set(theirs))
        raise ConfigError(f"--algorithm.teacher {teacher.path}: its tokenizer's vocabulary ({len(theirs)} tokens) is "
                          f"not the student's ({len(mine)} tokens, {differ} differ); on-policy distillation needs "
                          "a teacher with the student's tokenizer")


def scoring_engines() -> list[str]:
    """The registered ``--engine`` names whose engine scores given tokens (``Engine.token_logprobs``)."""
    from gcore import registry

    found = []
    for name in registry.names("engine"):
        cls = registry.load("engine", name)
        if isinstance(cls, type) and issubclass(cls, Engine) and cls.token_logprobs is not Engine.token_logprobs:
            found.append(name)
    return found or ["hf"]

