"""One SPMD controller: the step (docs/concepts.md) for this rank's shard of prompts.

Every rank runs the same ``Controller.step``. A controller generates, scores and prepares its own
samples; it meets the other controllers only in collectives (global statistics, the gradient
all-reduce inside the backend, and the step's telemetry).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gcore.algorithms.base import Algorithm
from gcore.backends.base import TrainingBackend
from gcore.engines.base import Engine
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
    that differ.
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

    def __post_init__(self) -> None:
        self.algorithm.setup(self.sampling.max_new_tokens)
        self._reward_errors, self._first_reward_error = 0, None

    def step(self, step: int, prompts: list[Prompt], on_stage: Callable[[str], None] | None = None) -> dict[str, float]:
        timer = StageTimer(on_stage)
        step_start = time.perf_counter()
        self._reward_errors, self._first_reward_error = 0, None
        samples = self.rollout(prompts, timer)
        kept, samples, filter_metrics = self.filter(step, prompts, samples, timer)
        batch = self.prepare(kept, samples, timer)
        train_metrics = self.train(batch, timer)
        synced_bytes = self.sync(timer)
        self.last_samples = samples
        return self.log(step, timer, step_start, samples, len(kept), [filter_metrics, train_metrics], synced_bytes)

    # -- the stages, in the order of a step ------------------------------------------------------
    def rollout(self, prompts: list[Prompt], timer: StageTimer, first_group: int = 0) -> list[Sample]:
        """GENERATE and REWARD: ``n`` samples per prompt from the rollout engine, scored and shaped
        (groups numbered from ``first_group``). The placement policy runs the ``RolloutJob``: it
        decides where and in what order."""
        job = RolloutJob(prompts, self.sampling, self.engine, self.reward, self.algorithm, self.tokenizer, timer,
                         first_group)
        samples = self.placement.rollout(job)
        self._reward_errors += job.reward_errors
        self._first_reward_error = self._first_reward_error or job.first_reward_error
        return samples

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
            return self.engine.update_weights(self.backend.named_weights())

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
    def _collate(self, kept: list[Sample], samples: list[Sample]) -> RolloutBatch:
        """The kept samples as a padded batch with the algorithm's loss mask; with none kept, one sample
        with a zero mask, so that this controller joins the collectives with zero weight."""
        batch = collate(kept or samples[:1], self.tokenizer.pad_token_id, self.sampling.temperature)
        if not kept:
            batch.response_mask.zero_()
        batch.response_mask = self.algorithm.loss_mask(batch)
        return batch

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
