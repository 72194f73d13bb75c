"""One SPMD controller: the step (docs/concepts.md) for this rank's shard of prompts.

Every rank runs the same ``Controller.step``. A controller generates, scores and prepares its own
samples; it meets the other controllers only in collectives (global statistics, the gradient
all-reduce inside the backend, and the step's telemetry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gcore.algorithms.base import Algorithm
from gcore.backends.base import TrainingBackend
from gcore.engines.base import Engine
from gcore.envs.base import Environment, SingleTurn
from gcore.inflight import InFlightRollouts, next_round
from gcore.placement.base import PlacementPolicy, Telemetry
from gcore.rewards.base import RewardModel
from gcore.rollout import LOCAL_STAGES, STAGES, RolloutJob, StageTimer
from gcore.types import Prompt, RolloutBatch, Sample, SamplingParams, collate

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

__all__ = ["LOCAL_STAGES", "STAGES", "Controller", "StageTimer", "StepRecord"]


@dataclass
class StepRecord:
    """What one step's stages hand each other, and what the trainer reads after the step.

    ``Controller.step`` makes one per step and passes it through the stages in order; each stage
    fills its part. Nothing of a step is kept on the controller.
    """

    step: int
    prompts: list[Prompt]  # this controller's share of the step's prompts
    timer: StageTimer  # wall-clock seconds per stage
    started: float = field(default_factory=time.perf_counter)
    samples: list[Sample] = field(default_factory=list)  # every sample generated (dynamic sampling: every round)
    kept: list[Sample] = field(default_factory=list)  # the samples trained (FILTER kept them, at most the share)
    rounds: int = 1  # rollouts FILTER ran to fill the share
    #: rollouts asked for this step so far (the one started ahead counts): each samples from its own seed
    rollouts: int = 0
    groups_accepted: int = 0  # the groups FILTER would keep (may exceed the share; the rest are not trained)
    reward_errors: int = 0  # samples whose reward failed and got the fallback (``reward/errors``)
    first_reward_error: str | None = None
    rollout_wait_s: float = 0.0  # seconds waited for a rollout started ahead (``max_staleness``)
    #: samples thrown away at collection and generated again with the current weights, because a sample of
    #: their group would have been trained more than ``max_staleness`` versions old (``async/regenerated_stale``)
    regenerated_stale: int = 0
    synced_bytes: int = 0  # the weights SYNC sent to the rollout engine
    #: multi-turn episodes' counts (``EpisodeStats.counts``: episodes, turns, steps, errors, truncated, an
    #: environment's own ``Turn.metrics``), logged as ``env/<name>`` summed over every rank
    env_counts: dict[str, float] = field(default_factory=dict)
    #: the batch PREPARE made, trained (its ``row_ids`` index ``kept``): what rollout tracing reads after the step
    batch: RolloutBatch | None = None
    #: the step's metrics: each stage adds its part; ``log`` completes them over every rank
    metrics: dict[str, float] = field(default_factory=dict)

    def count_reward_errors(self, job: RolloutJob) -> None:
        """Add the samples of ``job`` whose scoring failed."""
        self.reward_errors += job.reward_errors
        self.first_reward_error = self.first_reward_error or job.first_reward_error

    def add_env_stats(self, job: RolloutJob) -> None:
        """Add what the episode loop of ``job`` counted (multi-turn rollouts only)."""
        stats = job.env_stats
        if stats is None:
            return
        for name, value in (*stats.counts.items(), ("step_s", stats.env_busy_s),
                            ("generate_calls", float(stats.generate_calls))):
            self.env_counts[name] = self.env_counts.get(name, 0.0) + value


@dataclass
class Controller:
    """Runs the stages for one rank; the trainer calls ``step`` once per training step.

    ``step`` is the whole step, one named method per stage, each handed the step's ``StepRecord``:
    ``collect`` (GENERATE and REWARD, asked of the placement policy), ``filter``, ``end_rollout``,
    ``run_ahead``, ``prepare``, ``train``, ``sync``, ``place`` (the placement policy re-decides
    from every rank's stage times), ``dispatch`` and ``log``. A variant of the step (the one-controller baseline
    in ``single_controller.py``) overrides only the stages that differ. The rollouts that run ahead of their
    step (``--trainer.max_staleness`` K >= 1, docs/asynchronous.md) are ``rollouts``'s (``InFlightRollouts``):
    ``collect`` takes the one started K steps before (regenerating any group with a sample more than K
    versions old), ``run_ahead`` starts those of the next K steps before ``train``, and ``dispatch`` the one
    after them as soon as its weights exist; with K = 0 all three are the synchronous step's.
    """

    fabric: Fabric
    engine: Engine
    reward: RewardModel
    algorithm: Algorithm
    backend: TrainingBackend
    placement: PlacementPolicy
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    #: the rollouts that run ahead of their step, and the extra prompts of dynamic sampling (``draw_prompts``)
    rollouts: InFlightRollouts = field(default_factory=InFlightRollouts)
    #: the environment of multi-turn episodes (``--env``; ``SingleTurn``: one turn per sample)
    env: Environment = field(default_factory=SingleTurn)

    def __post_init__(self) -> None:
        #: the training steps the engine's weights have had; set at the first step (a resumed run's start)
        self.policy_version: int | None = None

    def setup(self) -> None:
        """Tell the other plugins what this controller will run: the generation budget to the
        algorithm, the tokenizer to the environment, and the job factory to the rollouts in flight
        (which tell the placement policy that rollouts may overlap training). Called once by the
        trainer before the first step."""
        self.algorithm.setup(self.sampling.max_new_tokens)
        self.env.setup(self.tokenizer)
        self.rollouts.setup(self.placement, self._job, self.fabric.global_rank, self.fabric.world_size,
                            self.algorithm.max_rounds)

    def step(self, step: int, prompts: list[Prompt], on_stage: Callable[[str], None] | None = None) -> StepRecord:
        """One training step on ``prompts``; returns its record (``record.metrics``: the logged
        metrics)."""
        record = StepRecord(step, prompts, StageTimer(on_stage))
        for stage, seconds in self.rollouts.take_dispatched().seconds.items():
            record.timer.add(stage, seconds)
        if self.policy_version is None:
            self.policy_version = step
        self.collect(record)
        self.filter(record)
        self.end_rollout(record)
        self.run_ahead(record)
        batch = record.batch = self.prepare(record)
        self.train(record, batch)
        self.sync(record)
        self.place(record)
        self.dispatch(record)
        self.log(record)
        return record

    # -- the stages, in the order of a step ------------------------------------------------------
    def collect(self, record: StepRecord) -> None:
        """GENERATE and REWARD of this step: the rollout started ahead for it, waited for, or else
        ``rollout`` now."""
        collected = self.rollouts.collect(record.step, record.timer)
        if collected is None:
            extra = self.rollouts.extra_prompts(len(record.prompts))
            record.samples = self.rollout(record, record.prompts + extra)
            return
        record.rollouts = 1  # the one started ahead
        record.samples, record.rollout_wait_s = collected.samples, collected.wait_s
        record.count_reward_errors(collected.job)
        record.add_env_stats(collected.job)
        record.samples, record.regenerated_stale = self.rollouts.bound_staleness(
            record.step, record.samples, lambda prompts: self.rollout(record, prompts))

    def rollout(self, record: StepRecord, prompts: list[Prompt], first_group: int = 0) -> list[Sample]:
        """GENERATE and REWARD: ``n`` samples per prompt from the rollout engine, scored and shaped
        (groups numbered from ``first_group``). The placement policy runs the ``RolloutJob``: it
        decides where and in what order."""
        job = self._job(prompts, record.timer, first_group, seed=self.rollouts.rollout_seed(record.step,
                                                                                              record.rollouts))
        record.rollouts += 1
        samples = self.placement.rollout(job)
        record.count_reward_errors(job)
        record.add_env_stats(job)
        return samples

    def filter(self, record: StepRecord) -> None:
        """FILTER: the algorithm may drop whole groups; with ``max_rounds`` > 1 this controller samples
        more prompts of its own until its share (``len(prompts)`` groups) is full (dynamic sampling),
        without waiting for any other controller."""
        target, n = len(record.prompts), self.sampling.n
        kept = self._keep_groups(record.samples)
        draw = self.rollouts.draw_prompts
        while len(kept) < target * n and record.rounds < self.algorithm.max_rounds and draw is not None:
            samples = record.samples
            extra = draw(next_round(target, len(kept) // n, len(samples) // n))
            more = self.rollout(record, extra, first_group=len(samples) // n)
            record.samples, kept, record.rounds = samples + more, kept + self._keep_groups(more), record.rounds + 1
        record.groups_accepted = len(kept) // n
        record.kept = kept[: target * n]
        self.rollouts.kept(record.groups_accepted, len(record.samples) // n)
        if record.reward_errors:  # one line per step, however many samples got the fallback reward
            log.warning("step %d: %d sample(s) could not be scored and got the fallback reward (reward/errors); "
                        "the first: %s", record.step, record.reward_errors, record.first_reward_error or "(no detail)")

    def end_rollout(self, record: StepRecord) -> None:
        """This step generates no more. Nothing to do with one controller per process; the
        one-controller variant tells the other ranks here."""

    def run_ahead(self, record: StepRecord) -> None:
        """Start the rollouts of the next ``max_staleness`` steps that are not in flight yet, with the
        weights the engine has now: they generate while this step trains (``InFlightRollouts.run_ahead``)."""
        self.rollouts.run_ahead(record.step, record.timer)

    def dispatch(self, record: StepRecord) -> None:
        """DISPATCH (``--trainer.dispatch device``, with ``max_staleness`` K >= 1): start the rollout of step
        ``step + K + 1`` now that this step's weights are synced (``InFlightRollouts.dispatch``)."""
        self.rollouts.dispatch(record.step)

    def prepare(self, record: StepRecord) -> RolloutBatch:
        """PREPARE: the padded batch, the log-probabilities and values the loss needs, advantages."""
        self.rollouts.check_staleness(record.step, record.kept)
        with record.timer("prepare"):
            batch = self._collate(record.kept, record.samples)
            self._model_outputs(batch)
            batch.advantages = self.algorithm.advantages(batch)
        return batch

    def train(self, record: StepRecord, batch: RolloutBatch) -> None:
        """TRAIN: the algorithm's loss, gradients all-reduced over every rank."""
        with record.timer("train"):
            record.metrics.update(self.backend.train(batch, self.algorithm))

    def sync(self, record: StepRecord) -> None:
        """SYNC: the new weights go to the rollout engine, once the rollouts that run in a thread of this
        process (a generative judge's or multi-turn episodes' started ahead) are done: that wait counts
        as waiting for a rollout (``async/rollout_wait_s``)."""
        record.rollout_wait_s += self.placement.join_rollouts()
        with record.timer("swap"):
            self.placement.before_sync(self.engine)
        with record.timer("sync"):
            record.synced_bytes = self.engine.update_weights(self.backend.named_weights())
        assert self.policy_version is not None  # set by ``step``
        self.policy_version += 1

    def place(self, record: StepRecord) -> None:
        """PLACE: every rank's stage times are gathered (one all-gather) and the placement policy
        re-decides where the next steps run from them (``placement.update``); the slowest rank's
        times, the imbalance between ranks and the policy's decision go into the metrics."""
        record.timer.seconds["step"] = time.perf_counter() - record.started
        names = (*STAGES, "step", *self.placement.telemetry_keys)
        local = torch.tensor([*(record.timer.seconds.get(s, 0.0) for s in names), _peak_rss_gb()],
                             dtype=torch.float64)
        if self.fabric.world_size > 1:
            gathered = _tensor(self.fabric.all_gather(local)).reshape(self.fabric.world_size, len(names) + 1)
        else:
            gathered = local.unsqueeze(0)
        rss, gathered = gathered[:, -1], gathered[:, :-1]
        per_rank = [dict(zip(names, row.tolist(), strict=True)) for row in gathered]
        updates = self.placement.update(Telemetry(record.step, per_rank, self.rollouts.judge_scale(record.step)))
        metrics = record.metrics
        metrics.update({f"time/{name}": float(gathered[:, i].max()) for i, name in enumerate(names)})
        # busy time: the stages a controller runs alone (the step time also holds the waits in collectives)
        busy = sum(gathered[:, names.index(stage)] for stage in LOCAL_STAGES)
        assert isinstance(busy, torch.Tensor)
        metrics["time/imbalance"] = float(busy.max() / busy.mean().clamp(min=1e-9))
        metrics.update({k if k.startswith("placement/") else f"placement/{k}": v for k, v in updates.items()})
        metrics["memory/peak_rss_gb"] = float(rss.max())  # the busiest process's high-water mark
        metrics["memory/rank0_peak_rss_gb"] = float(rss[0])

    def log(self, record: StepRecord) -> None:
        """LOG: the step's metrics over every rank: samples, FILTER's counts, staleness, weight sync."""
        metrics = record.metrics
        metrics.update(self._global_sample_metrics(record))
        metrics.update(self._filter_metrics(record))
        if self.rollouts.max_staleness:
            metrics.update(self.rollouts.staleness_metrics(record.step, record.kept, record.regenerated_stale,
                                                           record.rollout_wait_s, self._all_reduce))
        if self.env.multi_turn:
            metrics.update(self._env_metrics(record))
        metrics["sync/gb_per_s"] = record.synced_bytes / 1e9 / max(record.timer.seconds["sync"], 1e-9)
        metrics["sync/gb"] = record.synced_bytes / 1e9

    # -- what the stages are made of --------------------------------------------------------------
    def _job(self, prompts: list[Prompt], timer: StageTimer, first_group: int = 0, seed: int | None = None,
             version: int | None = None) -> RolloutJob:
        return RolloutJob(prompts, self.sampling, self.engine, self.reward, self.algorithm, self.tokenizer, timer,
                          first_group, policy_version=(self.policy_version or 0) if version is None else version,
                          env=self.env, seed=seed)

    def _collate(self, kept: list[Sample], samples: list[Sample]) -> RolloutBatch:
        """The kept samples as a padded batch with the algorithm's loss mask; with none kept, one sample
        with a zero mask, so that this controller joins the collectives with zero weight. When samples
        may be off-policy (``max_staleness``), the engine's log-probabilities are the behaviour policy's."""
        pad_id = self.tokenizer.pad_token_id
        assert isinstance(pad_id, int), "the tokenizer has a pad token (load_tokenizer sets one)"
        batch = collate(kept or samples[:1], pad_id, self.sampling.temperature)
        if not kept:
            batch.response_mask.zero_()
        batch.row_ids, batch.logprob_gaps = torch.arange(len(batch)), []  # rollout tracing's per-sample gaps
        batch.response_mask = self.algorithm.loss_mask(batch)
        if self.rollouts.max_staleness:
            batch.behaviour_logprobs = batch.engine_logprobs
            batch.policy_versions = torch.tensor([s.policy_version for s in kept or samples[:1]], dtype=torch.long)
        return batch

    def _env_metrics(self, record: StepRecord) -> dict[str, float]:
        """The episodes' counts summed over every rank (``env/<name>``), and turns per episode. Ranks may
        count different names (an environment's own ``Turn.metrics``): the names are gathered first."""
        counts = record.env_counts
        names = sorted(counts)
        if self.fabric.world_size > 1:
            import torch.distributed as dist

            everyone: list[list[str] | None] = [None] * self.fabric.world_size
            dist.all_gather_object(everyone, names)
            names = sorted({name for part in everyone for name in part or []})
        totals = self._all_reduce(torch.tensor([counts.get(n, 0.0) for n in names], dtype=torch.float64), "sum")
        out = {f"env/{name}": float(value) for name, value in zip(names, totals.tolist(), strict=True)}
        out["env/turns_mean"] = out.get("env/turns", 0.0) / max(out.get("env/episodes", 0.0), 1.0)
        return out

    def _model_outputs(self, batch: RolloutBatch) -> None:
        """The values and log-probabilities the algorithm needs, on ``batch``'s rows (set in place)."""
        if self.algorithm.needs_critic:
            batch.values = self.backend.compute_values(batch)
        if self.algorithm.needs_old_logprobs:
            batch.old_logprobs = self.backend.compute_logprobs(batch, "policy")
        if self.algorithm.needs_reference:
            batch.ref_logprobs = self.backend.compute_logprobs(batch, "reference")
        if self.algorithm.teacher_path is not None:
            batch.teacher_logprobs = self.backend.compute_logprobs(batch, "teacher")

    def _filter_metrics(self, record: StepRecord) -> dict[str, float]:
        """FILTER's counts over every rank: one all-reduce, after the fact, so no controller waits for
        another while sampling."""
        n, target = self.sampling.n, len(record.prompts)
        sampled, accepted = len(record.samples) // n, record.groups_accepted
        sums = self._all_reduce(torch.tensor([sampled, accepted, min(accepted, target)], dtype=torch.float64), "sum")
        most_rounds = self._all_reduce(torch.tensor([float(record.rounds)], dtype=torch.float64), "max")
        return {
            "filter/groups_sampled": float(sums[0]),
            "filter/groups_dropped": float(sums[0] - sums[1]),
            "filter/groups_trained": float(sums[2]),
            "filter/groups_surplus": float(sums[1] - sums[2]),
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

    def _global_sample_metrics(self, record: StepRecord) -> dict[str, float]:
        """Reward and length statistics over every rank's samples (one all-reduce)."""
        samples = record.samples
        raw = torch.tensor([s.reward_info["raw"] for s in samples], dtype=torch.float64)
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        local = torch.tensor([
            len(samples),
            raw.sum(),
            raw.pow(2).sum(),
            lengths.sum(),
            sum(not s.finished for s in samples),
            len(record.kept),
            record.reward_errors,
            sum(len(s.prompt.token_ids) for s in samples),
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
            "prompt_length/mean": float(total[7]) / count,  # tokens, per sample
            "response/truncated_frac": float(total[4]) / count,
            "samples/total": float(total[0]),
            "samples/trained": float(total[5]),
        }

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.fabric.world_size == 1:
            return tensor
        return _tensor(self.fabric.all_reduce(tensor, reduce_op=op))


def _tensor(result: object) -> torch.Tensor:
    """A Fabric collective's result for one tensor (Fabric types it for collections of tensors too)."""
    assert isinstance(result, torch.Tensor)
    return result


def _peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1e9 if sys.platform == "darwin" else 1e6 / 1.024)
