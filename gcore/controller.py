"""One SPMD controller: the step (docs/concepts.md) for this rank's shard of prompts.

Every rank runs the same ``Controller.step``. A controller generates, scores and prepares its own
samples; it meets the other controllers only in collectives (global statistics, the gradient
all-reduce inside the backend, and the step's telemetry).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gcore.algorithms.base import Algorithm
from gcore.backends.base import TrainingBackend
from gcore.engines.base import Engine
from gcore.errors import ConfigError
from gcore.placement.base import PlacementPolicy, Telemetry
from gcore.rewards.base import RewardModel
from gcore.rollout import LOCAL_STAGES, STAGES, RolloutJob, StageTimer
from gcore.types import Prompt, RolloutBatch, Sample, SamplingParams, collate

if TYPE_CHECKING:
    from lightning.fabric import Fabric
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

__all__ = ["LOCAL_STAGES", "STAGES", "Controller", "StageTimer"]


@dataclass
class Controller:
    """Runs the stages for one rank; the trainer calls ``step`` once per training step.

    ``step`` is the whole step, one named method per stage: ``rollout`` (GENERATE and REWARD, asked
    of the placement policy), ``filter``, ``prepare``, ``train``, ``sync`` and ``log``. A variant of
    the step (the one-controller baseline in ``single_controller.py``) overrides only the stages
    that differ. With ``max_staleness`` 1 (docs/asynchronous.md), ``collect`` takes the rollout
    started during the step before, and ``run_ahead`` starts the next step's before ``train``.
    """

    fabric: Fabric
    engine: Engine
    reward: RewardModel
    algorithm: Algorithm
    backend: TrainingBackend
    placement: PlacementPolicy
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    #: draws ``k`` more prompts for this controller alone (dynamic sampling); ``None``: no re-sampling
    draw_prompts: Callable[[int], list[Prompt]] | None = None
    last_samples: list[Sample] | None = None  # the last step's samples (the trainer learns lengths from them)
    #: rollouts of the next steps may run while this step trains, with weights up to this many steps old
    #: (``--trainer.max_staleness``; 0: the synchronous step). Needs ``placement.supports_overlap``.
    max_staleness: int = 0

    def __post_init__(self) -> None:
        self.algorithm.setup(self.sampling.max_new_tokens)
        self._reward_errors, self._first_reward_error = 0, None
        #: the training steps the engine's weights have had; set at the first step (a resumed run's start)
        self.policy_version: int | None = None
        self._ahead: dict[int, tuple[RolloutJob, Callable[[], list[Sample]]]] = {}  # step -> rollout in flight
        self._wait_s = 0.0
        if self.max_staleness:
            if not self.placement.supports_overlap:
                raise ConfigError(f"--trainer.max_staleness {self.max_staleness}: {type(self.placement).__name__} "
                                  "runs no rollout while the controller trains")
            self.placement.allow_overlap()

    def step(self, step: int, prompts: list[Prompt], on_stage: Callable[[str], None] | None = None,
             upcoming: Sequence[list[Prompt]] = ()) -> dict[str, float]:
        """One training step on ``prompts``. ``upcoming``: the prompts of the next steps; with
        ``max_staleness`` K >= 1 the rollouts of the next K of them are started before this step
        trains, and collected by the steps they belong to."""
        timer = StageTimer(on_stage)
        step_start = time.perf_counter()
        self._reward_errors, self._first_reward_error = 0, None
        if self.policy_version is None:
            self.policy_version = step
        samples = self.collect(step, prompts, timer)
        kept, samples, filter_metrics = self.filter(step, prompts, samples, timer)
        self.run_ahead(step, upcoming, timer)
        batch = self.prepare(kept, samples, timer)
        train_metrics = self.train(batch, timer)
        synced_bytes = self.sync(timer)
        self.last_samples = samples
        parts = [filter_metrics, train_metrics]
        if self.max_staleness:
            parts.append(self._staleness_metrics(step, kept))
        return self.log(step, timer, step_start, samples, len(kept), parts, synced_bytes)

    # -- the stages, in the order of a step ------------------------------------------------------
    def collect(self, step: int, prompts: list[Prompt], timer: StageTimer) -> list[Sample]:
        """GENERATE and REWARD of this step: the rollout started ahead for it, waited for, or else
        ``rollout`` now."""
        if step not in self._ahead:
            return self.rollout(prompts, timer)
        job, result = self._ahead.pop(step)
        if [p.index for p in job.prompts] != [p.index for p in prompts]:
            raise RuntimeError(f"step {step}: the rollout started ahead was for other prompts than the step's")
        job.timer = timer
        started = time.perf_counter()
        samples = result()
        self._wait_s = time.perf_counter() - started
        self._count_reward_errors(job)
        return samples

    def rollout(self, prompts: list[Prompt], timer: StageTimer, first_group: int = 0) -> list[Sample]:
        """GENERATE and REWARD: ``n`` samples per prompt from the rollout engine, scored and shaped
        (groups numbered from ``first_group``). The placement policy runs the ``RolloutJob``: it
        decides where and in what order."""
        job = self._job(prompts, timer, first_group)
        samples = self.placement.rollout(job)
        self._count_reward_errors(job)
        return samples

    def run_ahead(self, step: int, upcoming: Sequence[list[Prompt]], timer: StageTimer) -> None:
        """Start the rollouts of the next ``max_staleness`` steps that are not in flight yet, with the
        weights the engine has now: they generate while this step trains (``placement.start_rollout``;
        the weight update after it queues behind them)."""
        for offset, prompts in enumerate(upcoming[: self.max_staleness], start=1):
            if step + offset not in self._ahead and prompts:
                job = self._job(prompts, timer)
                self._ahead[step + offset] = (job, self.placement.start_rollout(job))

    def filter(
        self, step: int, prompts: list[Prompt], samples: list[Sample], timer: StageTimer
    ) -> tuple[list[Sample], list[Sample], dict[str, float]]:
        """FILTER: the algorithm may drop whole groups; with ``max_rounds`` > 1 this controller samples
        more prompts of its own until its share (``len(prompts)`` groups) is full (dynamic sampling).
        Returns (the samples to train, every sample, FILTER's metrics over every rank)."""
        kept, samples, rounds = self._resample(prompts, samples, timer)
        self._end_rollout()
        self._warn_reward_errors(step)
        n = self.sampling.n
        metrics = self._filter_metrics(len(samples) // n, len(kept) // n, len(prompts), rounds)
        return kept[: len(prompts) * n], samples, metrics

    def prepare(self, kept: list[Sample], samples: list[Sample], timer: StageTimer) -> RolloutBatch:
        """PREPARE: the padded batch, the log-probabilities and values the loss needs, advantages."""
        with timer("prepare"):
            batch = self._collate(kept, samples)
            self._model_outputs(batch)
            batch.advantages = self.algorithm.advantages(batch)
        return batch

    def train(self, batch: RolloutBatch, timer: StageTimer) -> dict[str, float]:
        """TRAIN: the algorithm's loss, gradients all-reduced over every rank."""
        with timer("train"):
            return self.backend.train(batch, self.algorithm)

    def sync(self, timer: StageTimer) -> int:
        """SYNC: the new weights go to the rollout engine; returns the bytes it received."""
        with timer("swap"):
            self.placement.before_sync(self.engine)
        with timer("sync"):
            synced = self.engine.update_weights(self.backend.named_weights())
        assert self.policy_version is not None  # set by ``step``
        self.policy_version += 1
        return synced

    def log(self, step: int, timer: StageTimer, step_start: float, samples: list[Sample], kept: int,
            parts: list[dict[str, float]], synced_bytes: int) -> dict[str, float]:
        """The step's metrics over every rank: samples, the stages' ``parts``, telemetry, weight sync."""
        timer.seconds["step"] = time.perf_counter() - step_start
        metrics = self._global_sample_metrics(samples, kept)
        for part in parts:
            metrics.update(part)
        metrics.update(self._telemetry(step, timer.seconds))
        metrics["sync/gb_per_s"] = synced_bytes / 1e9 / max(timer.seconds["sync"], 1e-9)
        metrics["sync/gb"] = synced_bytes / 1e9
        return metrics

    # -- what the stages are made of --------------------------------------------------------------
    def _job(self, prompts: list[Prompt], timer: StageTimer, first_group: int = 0) -> RolloutJob:
        return RolloutJob(prompts, self.sampling, self.engine, self.reward, self.algorithm, self.tokenizer, timer,
                          first_group, policy_version=self.policy_version or 0)

    def _count_reward_errors(self, job: RolloutJob) -> None:
        self._reward_errors += job.reward_errors
        self._first_reward_error = self._first_reward_error or job.first_reward_error

    def _collate(self, kept: list[Sample], samples: list[Sample]) -> RolloutBatch:
        """The kept samples as a padded batch with the algorithm's loss mask; with none kept, one sample
        with a zero mask, so that this controller joins the collectives with zero weight. When samples
        may be off-policy (``max_staleness``), the engine's log-probabilities are the behaviour policy's."""
        batch = collate(kept or samples[:1], self.tokenizer.pad_token_id, self.sampling.temperature)
        if not kept:
            batch.response_mask.zero_()
        batch.response_mask = self.algorithm.loss_mask(batch)
        if self.max_staleness:
            batch.behaviour_logprobs = batch.engine_logprobs
            batch.policy_versions = torch.tensor([s.policy_version for s in kept or samples[:1]], dtype=torch.long)
        return batch

    def _staleness_metrics(self, step: int, kept: list[Sample]) -> dict[str, float]:
        """How many versions old the trained samples were (``step - policy_version``), over every rank,
        and the slowest controller's wait for its rollout to come in."""
        ages = torch.tensor([float(step - s.policy_version) for s in kept], dtype=torch.float64)
        sums = self._all_reduce(torch.tensor([ages.sum(), len(ages)], dtype=torch.float64), "sum")
        most = self._all_reduce(torch.tensor([ages.max() if len(ages) else 0.0, self._wait_s],
                                             dtype=torch.float64), "max")
        self._wait_s = 0.0
        return {"async/staleness_mean": float(sums[0] / sums[1].clamp(min=1.0)),
                "async/staleness_max": float(most[0]), "async/rollout_wait_s": float(most[1])}

    def _model_outputs(self, batch: RolloutBatch) -> None:
        """The values and log-probabilities the algorithm needs, on ``batch``'s rows (set in place)."""
        if self.algorithm.needs_critic:
            batch.values = self.backend.compute_values(batch)
        if self.algorithm.needs_old_logprobs:
            batch.old_logprobs = self.backend.compute_logprobs(batch, "policy")
        if self.algorithm.needs_reference:
            batch.ref_logprobs = self.backend.compute_logprobs(batch, "reference")

    def _end_rollout(self) -> None:
        """Called when this step generates no more (after dynamic sampling); nothing to do here."""

    def _warn_reward_errors(self, step: int) -> None:
        """One line per step, however many samples got a fallback reward (``reward/errors`` counts them)."""
        if self._reward_errors:
            log.warning("step %d: %d sample(s) could not be scored and got the fallback reward (reward/errors); "
                        "the first: %s", step, self._reward_errors, self._first_reward_error or "(no detail)")

    def _resample(
        self, prompts: list[Prompt], samples: list[Sample], timer: StageTimer
    ) -> tuple[list[Sample], list[Sample], int]:
        """The local part of FILTER: (kept samples, possibly more than the share; all samples; rounds)."""
        target, n = len(prompts), self.sampling.n
        kept, rounds = self._keep_groups(samples), 1
        while len(kept) < target * n and rounds < self.algorithm.max_rounds and self.draw_prompts is not None:
            missing = target - len(kept) // n
            keep_rate = max(len(kept) / len(samples), 1.0 / (len(samples) // n))  # at worst, one group in all
            extra = self.draw_prompts(min(math.ceil(missing / keep_rate), 4 * target))
            more = self.rollout(extra, timer, first_group=len(samples) // n)
            samples, kept, rounds = samples + more, kept + self._keep_groups(more), rounds + 1
        return kept, samples, rounds

    def _filter_metrics(self, sampled: int, accepted: int, target: int, rounds: int) -> dict[str, float]:
        """FILTER's counts over every rank: one all-reduce, after the fact, so no controller waits for
        another while sampling."""
        sums = self._all_reduce(torch.tensor([sampled, accepted, min(accepted, target)], dtype=torch.float64), "sum")
        most_rounds = self._all_reduce(torch.tensor([float(rounds)], dtype=torch.float64), "max")
        return {
            "filter/groups_sampled": float(sums[0]),
            "filter/groups_dropped": float(sums[0] - sums[1]),
            "filter/groups_trained": float(sums[2]),
            "filter/rounds_max": float(most_rounds[0]),
        }

    def _keep_groups(self, samples: list[Sample]) -> list[Sample]:
        groups: dict[int, list[Sample]] = {}
        for sample in samples:
            groups.setdefault(sample.group, []).append(sample)
        kept = []
        for members in groups.values():
            if self.algorithm.keep_group(torch.tensor([s.reward for s in members])):
                kept.extend(members)
        return kept

    def _global_sample_metrics(self, samples: list[Sample], kept: int) -> dict[str, float]:
        """Reward and length statistics over every rank's samples (one all-reduce)."""
        raw = torch.tensor([s.reward_info["raw"] for s in samples], dtype=torch.float64)
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        local = torch.tensor([
            len(samples),
            raw.sum(),
            raw.pow(2).sum(),
            lengths.sum(),
            sum(not s.finished for s in samples),
            kept,
            self._reward_errors,
        ], dtype=torch.float64)
        total = self._all_reduce(local, "sum")
        count = max(float(total[0]), 1.0)
        mean = float(total[1]) / count
        var = max(float(total[2]) / count - mean * mean, 0.0)
        local_max = torch.tensor([lengths.max() if len(lengths) else 0.0], dtype=torch.float64)
        return {
            "reward/mean": mean,
            "reward/std": var**0.5,
            "reward/errors": float(total[6]),
            "response_length/mean": float(total[3]) / count,
            "response_length/max": float(self._all_reduce(local_max, "max")[0]),
            "response/truncated_frac": float(total[4]) / count,
            "samples/total": float(total[0]),
            "samples/trained": float(total[5]),
        }

    def _telemetry(self, step: int, seconds: dict[str, float]) -> dict[str, float]:
        """Every rank's stage times; logged as the slowest rank's, with the imbalance between ranks."""
        names = (*STAGES, "step", *self.placement.telemetry_keys)
        local = torch.tensor([*(seconds.get(s, 0.0) for s in names), _peak_rss_gb()], dtype=torch.float64)
        if self.fabric.world_size > 1:
            gathered = self.fabric.all_gather(local).reshape(self.fabric.world_size, len(names) + 1)
        else:
            gathered = local.unsqueeze(0)
        rss, gathered = gathered[:, -1], gathered[:, :-1]
        per_rank = [dict(zip(names, row.tolist(), strict=False)) for row in gathered]
        updates = self.placement.update(Telemetry(step, per_rank))
        metrics = {f"time/{name}": float(gathered[:, i].max()) for i, name in enumerate(names)}
        # busy time: the stages a controller runs alone (the step time also holds the waits in collectives)
        busy = sum(gathered[:, names.index(stage)] for stage in LOCAL_STAGES)
        metrics["time/imbalance"] = float(busy.max() / busy.mean().clamp(min=1e-9))
        metrics.update({k if k.startswith("placement/") else f"placement/{k}": v for k, v in updates.items()})
        metrics["memory/peak_rss_gb"] = float(rss.max())  # the busiest process's high-water mark
        metrics["memory/rank0_peak_rss_gb"] = float(rss[0])
        return metrics

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.fabric.world_size == 1:
            return tensor
        return self.fabric.all_reduce(tensor, reduce_op=op)


def _peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1e9 if sys.platform == "darwin" else 1e6 / 1.024)
