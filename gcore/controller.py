"""One SPMD controller: the step (docs/concepts.md) for this rank's shard of prompts.

Every rank runs the same ``Controller.step``. A controller generates, scores and prepares its own
samples; it meets the other controllers only in collectives (global statistics, the gradient
all-reduce inside the backend, and the step's telemetry).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gcore.algorithms.base import Algorithm
from gcore.backends.base import TrainingBackend
from gcore.engines.base import Engine
from gcore.errors import RewardError
from gcore.placement.base import PlacementPolicy, Telemetry
from gcore.rewards.base import RewardModel, as_reward, describe_sample
from gcore.types import Generation, Prompt, Sample, SamplingParams, collate

if TYPE_CHECKING:
    from lightning.fabric import Fabric
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

STAGES = ("generate", "reward", "swap", "prepare", "train", "sync")
LOCAL_STAGES = ("generate", "reward", "swap", "prepare")  # no collective inside: a controller's own work


class StageTimer:
    """Wall-clock seconds per stage of one step."""

    def __init__(self, on_stage: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_stage = on_stage

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.on_stage:
            self.on_stage(stage)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


@dataclass
class Controller:
    """Runs the stages for one rank; the trainer calls ``step`` once per training step."""

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

        # GENERATE and REWARD: n samples per prompt from the rollout engine, scored and shaped
        samples = self._rollout(prompts, timer, first_group=0)

        # FILTER: the algorithm may drop whole groups; with max_rounds > 1 this controller samples
        # more prompts of its own until its share (len(prompts) groups) is full (dynamic sampling)
        kept, samples, filter_metrics = self._fill_batch(prompts, samples, timer)
        self._warn_reward_errors(step)

        # PREPARE: padded batch, log-probabilities the loss needs, advantages
        with timer("prepare"):
            batch = collate(kept or samples[:1], self.tokenizer.pad_token_id, self.sampling.temperature)
            if not kept:
                batch.response_mask.zero_()  # nothing to learn from: join the collectives with zero weight
            batch.response_mask = self.algorithm.loss_mask(batch)
            if self.algorithm.needs_critic:
                batch.values = self.backend.compute_values(batch)
            if self.algorithm.needs_old_logprobs:
                batch.old_logprobs = self.backend.compute_logprobs(batch, "policy")
            if self.algorithm.needs_reference:
                batch.ref_logprobs = self.backend.compute_logprobs(batch, "reference")
            batch.advantages = self.algorithm.advantages(batch)

        # TRAIN: the algorithm's loss, gradients all-reduced over every rank
        with timer("train"):
            train_metrics = self.backend.train(batch, self.algorithm, self.sampling.max_new_tokens)

        # SYNC: the new weights go to the rollout engine
        with timer("swap"):
            self.placement.before_sync(self.engine)
        with timer("sync"):
            synced_bytes = self.engine.update_weights(self.backend.named_weights())

        self.last_samples = samples
        return self._step_metrics(step, timer, step_start, samples, len(kept), [filter_metrics, train_metrics],
                                  synced_bytes)

    def _warn_reward_errors(self, step: int) -> None:
        """One line per step, however many samples got a fallback reward (``reward/errors`` counts them)."""
        if self._reward_errors:
            log.warning("step %d: %d sample(s) could not be scored and got the fallback reward (reward/errors); "
                        "the first: %s", step, self._reward_errors, self._first_reward_error or "(no detail)")

    def _step_metrics(self, step: int, timer: StageTimer, step_start: float, samples: list[Sample], kept: int,
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

    def _rollout(self, prompts: list[Prompt], timer: StageTimer, first_group: int) -> list[Sample]:
        """GENERATE and REWARD, run by the placement policy (which decides where and in what order)."""
        return self.placement.rollout(self, prompts, timer, first_group)

    def make_samples(self, prompts: list[Prompt], outputs: list[list[Generation]], first_group: int) -> list[Sample]:
        """One ``Sample`` per generation; the groups of ``prompts`` are numbered from ``first_group``."""
        return [
            Sample(
                prompt=prompt,
                group=first_group + group,
                response_ids=g.token_ids,
                response_logprobs=g.logprobs,
                response_text=self.tokenizer.decode(g.token_ids, skip_special_tokens=True),
                finished=g.finished,
            )
            for group, (prompt, generations) in enumerate(zip(prompts, outputs, strict=False))
            for g in generations
        ]

    def score(self, samples: list[Sample], reward: RewardModel | None = None) -> None:
        """Reward the samples (with ``reward``, e.g. one scored in worker processes, instead of this
        controller's): the raw score is kept in ``reward_info["raw"]``, the algorithm shapes it."""
        reward = reward or self.reward
        raw = reward.score(samples)
        if len(raw) != len(samples):
            raise RewardError(f"{type(reward).__name__} returned {len(raw)} rewards for {len(samples)} samples")
        self._reward_errors += getattr(reward, "last_errors", 0)
        self._first_reward_error = self._first_reward_error or getattr(reward, "last_error", None)
        for sample, value in zip(samples, raw, strict=False):
            try:  # any reward model, not only the rule-based ones (which check their own values)
                value = as_reward(value)
            except (TypeError, ValueError) as err:
                name = type(reward).__name__
                raise RewardError(f"{name} gave {err} on sample ({describe_sample(sample)})") from None
            sample.reward_info["raw"] = value
            sample.reward = value
            sample.reward = float(self.algorithm.shape_reward(sample))

    def _fill_batch(
        self, prompts: list[Prompt], samples: list[Sample], timer: StageTimer
    ) -> tuple[list[Sample], list[Sample], dict[str, float]]:
        """Keep the groups the algorithm accepts; re-sample locally until ``len(prompts)`` groups are
        kept or ``algorithm.max_rounds`` rounds ran. Returns (kept samples, all samples, metrics)."""
        kept, samples, rounds = self._resample(prompts, samples, timer)
        n = self.sampling.n
        metrics = self._filter_metrics(len(samples) // n, len(kept) // n, len(prompts), rounds)
        return kept[: len(prompts) * n], samples, metrics

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
            more = self._rollout(extra, timer, first_group=len(samples) // n)
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
