"""One SPMD controller: the step (docs/concepts.md) for this rank's shard of prompts.

Every rank runs the same ``Controller.step``. A controller generates, scores and prepares its own
samples; it meets the other controllers only in collectives (global statistics, the gradient
all-reduce inside the backend, and the step's telemetry).
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gcore.algorithms.base import Algorithm
from gcore.backends.base import TrainingBackend
from gcore.engines.base import Engine
from gcore.envs.base import Environment
from gcore.errors import ConfigError
from gcore.placement.base import InFlight, PlacementPolicy, Telemetry
from gcore.rewards.base import RewardModel
from gcore.rollout import LOCAL_STAGES, STAGES, RolloutJob, StageTimer
from gcore.types import Generation, Prompt, RolloutBatch, Sample, SamplingParams, collate

if TYPE_CHECKING:
    from lightning.fabric import Fabric
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
    #: the rollout that starts next: its judged prompts over this step's (``Telemetry.judge_scale``)
    judge_scale: float = 1.0
    #: multi-turn episodes' counts (``EpisodeStats.counts``: episodes, turns, steps, errors, truncated, an
    #: environment's own ``Turn.metrics``), logged as ``env/<name>`` summed over every rank
    env_counts: dict[str, float] = field(default_factory=dict)
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
    in ``single_controller.py``) overrides only the stages that differ. With ``max_staleness`` K >= 1
    (docs/asynchronous.md), ``collect`` takes the rollout started K steps before (regenerating any
    group with a sample more than K versions old), and ``run_ahead`` starts the rollouts of the next K
    steps not yet in flight before ``train``; with ``early_dispatch``, ``dispatch`` starts the one after
    them as soon as its weights exist, after ``sync``.
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
    #: rollouts of the next steps may run while this step trains, with weights up to this many steps old
    #: (``--trainer.max_staleness``; 0: the synchronous step). Needs ``placement.supports_overlap``.
    max_staleness: int = 0
    #: partial rollouts (``--trainer.partial_rollouts``, with ``max_staleness``): a weight update stops the
    #: generation in flight between tokens, and the unfinished responses continue with the new weights
    partial_rollouts: bool = False
    #: when a rollout started ahead goes out (``--trainer.dispatch``, with ``max_staleness``): False (``step``), when
    #: the step K before it starts training (``run_ahead``); True (``device``), as soon as the weights it may be
    #: generated with exist (``dispatch``, after the step K + 1 before it synced), so that each engine worker starts
    #: it when it has finished its share of the rollouts before it, without waiting for the slowest worker. The same
    #: weights and seed either way: the samples are the same, only their timing differs.
    early_dispatch: bool = False
    #: dynamic sampling's extra prompts drawn up front (``--trainer.oversample``): each rollout starts with as many more
    #: prompts as the keep rate of the last step says its share will need, so that the step rarely waits for its
    #: verdicts to draw a second round; groups kept beyond the share are not trained (``filter/groups_surplus``)
    oversample: bool = False
    #: the dataset's prompts by index (a resumed run rebuilds the extra prompts of a rollout in flight from them)
    prompts_at: Callable[[list[int]], list[Prompt]] | None = None
    #: the environment of multi-turn episodes (``--env``); ``None`` or ``SingleTurn``: one turn per sample
    env: Environment | None = None
    #: the run's seed (``--trainer.seed``): each rollout on engine workers samples from a seed drawn from it, this
    #: rank, the step and the step's rollout count (``rollout_seed``), so that it samples the same whenever it runs
    seed: int = 0

    def __post_init__(self) -> None:
        #: the training steps the engine's weights have had; set at the first step (a resumed run's start)
        self.policy_version: int | None = None
        self._ahead: dict[int, tuple[RolloutJob, InFlight]] = {}  # step -> rollout in flight
        #: step -> a rollout in flight that the checkpoint resumed from recorded (``load_in_flight``), taken up by
        #: the step that collects it or starts it ahead
        self._resumed: dict[int, dict] = {}
        #: what starting a rollout in ``dispatch`` timed (a swap of partitions): added to the next step's stage times
        self._dispatched = StageTimer()
        #: groups kept / groups sampled at the last step's filter (``oversample``); ``None`` before the first
        self.keep_rate: float | None = None

    def setup(self) -> None:
        """Tell the other plugins what this controller will run: the generation budget to the
        algorithm, and to the placement policy that rollouts may overlap training. Called once by
        the trainer before the first step."""
        self.algorithm.setup(self.sampling.max_new_tokens)
        if self.env is not None:
            self.env.setup(self.tokenizer)
        if self.max_staleness:
            if not self.placement.supports_overlap:
                raise ConfigError(f"--trainer.max_staleness {self.max_staleness}: {type(self.placement).__name__} "
                                  "runs no rollout while the controller trains")
            self.placement.allow_overlap(partial=self.partial_rollouts)

    def step(self, step: int, prompts: list[Prompt], on_stage: Callable[[str], None] | None = None,
             upcoming: Sequence[list[Prompt]] = (), judge_scale: float = 1.0) -> StepRecord:
        """One training step on ``prompts``; returns its record (``record.metrics``: the logged
        metrics). ``upcoming``: the prompts of the next steps; with ``max_staleness`` K >= 1 the
        rollouts of the next K of them are started before this step trains, and collected by the
        steps they belong to. ``judge_scale``: the rollout that starts next has that many times this
        step's judged prompts (for the placement's decision; ``Telemetry.judge_scale``)."""
        record = StepRecord(step, prompts, StageTimer(on_stage), judge_scale=judge_scale)
        for stage, seconds in self._dispatched.seconds.items():
            record.timer.add(stage, seconds)
        self._dispatched = StageTimer()
        if self.policy_version is None:
            self.policy_version = step
        self.collect(record)
        self.filter(record)
        self.end_rollout(record)
        self.run_ahead(record, upcoming)
        batch = self.prepare(record)
        self.train(record, batch)
        self.sync(record)
        self.place(record)
        self.dispatch(record, upcoming)
        self.log(record)
        return record

    # -- the stages, in the order of a step ------------------------------------------------------
    def collect(self, record: StepRecord) -> None:
        """GENERATE and REWARD of this step: the rollout started ahead for it, waited for, or else
        ``rollout`` now."""
        self._take_resumed(record.step, record.prompts)
        if record.step not in self._ahead:
            record.samples = self.rollout(record, record.prompts + self._draw_extra(len(record.prompts)))
            return
        record.rollouts = 1  # the one started ahead
        job, result = self._ahead.pop(record.step)
        if [p.index for p in job.prompts[: len(record.prompts)]] != [p.index for p in record.prompts]:
            raise RuntimeError(f"step {record.step}: the rollout started ahead was for other prompts than the step's")
        job.timer = record.timer
        started = time.perf_counter()
        record.samples = result()
        record.rollout_wait_s = time.perf_counter() - started
        record.count_reward_errors(job)
        record.add_env_stats(job)
        self._bound_staleness(record)

    def _bound_staleness(self, record: StepRecord) -> None:
        """The strict bound of ``max_staleness`` K: a group with a sample that would be trained more than K
        versions old (``staleness``) is thrown away and generated again now, with the current weights, for
        the same prompt and under the same group number (counted in ``record.regenerated_stale``). The
        pipeline of ``run_ahead`` keeps every sample within K; this catches whatever did not (a rollout
        that came in later than planned, a placement that recorded an older version)."""
        limit = self.max_staleness
        stale = sorted({s.group for s in record.samples if staleness(s, record.step) > limit})
        if not stale:
            return
        members = {group: [s for s in record.samples if s.group == group] for group in stale}
        fresh = self.rollout(record, [members[group][0].prompt for group in stale])
        regenerated: dict[int, list[Sample]] = {group: [] for group in stale}
        for sample in fresh:  # numbered 0, 1, ... in the order of ``stale``: back to the groups they replace
            sample.group = stale[sample.group]
            regenerated[sample.group].append(sample)
        record.regenerated_stale += sum(len(m) for m in members.values())
        log.warning("step %d: %d sample(s) in %d group(s) would have been trained more than %d version(s) old "
                    "(--trainer.max_staleness): generated again with the current weights (async/regenerated_stale)",
                    record.step, record.regenerated_stale, len(stale), limit)
        samples: list[Sample] = []
        done: set[int] = set()
        for sample in record.samples:  # the groups in their order, the stale ones replaced
            if sample.group not in regenerated:
                samples.append(sample)
            elif sample.group not in done:
                samples.extend(regenerated[sample.group])
                done.add(sample.group)
        record.samples = samples

    def rollout(self, record: StepRecord, prompts: list[Prompt], first_group: int = 0) -> list[Sample]:
        """GENERATE and REWARD: ``n`` samples per prompt from the rollout engine, scored and shaped
        (groups numbered from ``first_group``). The placement policy runs the ``RolloutJob``: it
        decides where and in what order."""
        job = self._job(prompts, record.timer, first_group, seed=self._seed(record.step, record.rollouts))
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
        while len(kept) < target * n and record.rounds < self.algorithm.max_rounds and self.draw_prompts is not None:
            samples = record.samples
            extra = self.draw_prompts(next_round(target, len(kept) // n, len(samples) // n))
            more = self.rollout(record, extra, first_group=len(samples) // n)
            record.samples, kept, record.rounds = samples + more, kept + self._keep_groups(more), record.rounds + 1
        record.groups_accepted = len(kept) // n
        record.kept = kept[: target * n]
        if self._oversampling and record.samples:
            self.keep_rate = record.groups_accepted / (len(record.samples) // n)
        if record.reward_errors:  # one line per step, however many samples got the fallback reward
            log.warning("step %d: %d sample(s) could not be scored and got the fallback reward (reward/errors); "
                        "the first: %s", record.step, record.reward_errors, record.first_reward_error or "(no detail)")

    def end_rollout(self, record: StepRecord) -> None:
        """This step generates no more. Nothing to do with one controller per process; the
        one-controller variant tells the other ranks here."""

    def run_ahead(self, record: StepRecord, upcoming: Sequence[list[Prompt]]) -> None:
        """Start the rollouts of the next ``max_staleness`` steps that are not in flight yet, with the
        weights the engine has now: they generate while this step trains (``placement.start_rollout``;
        the weight update after it queues behind them)."""
        self._start_ahead(record.step, upcoming[: self.max_staleness], record.timer)

    def dispatch(self, record: StepRecord, upcoming: Sequence[list[Prompt]]) -> None:
        """DISPATCH (``dispatch`` ``"device"``, with ``max_staleness`` K >= 1): start the rollout of step
        ``step + K + 1`` now that this step's weights are synced, the version it may be generated with; ``run_ahead``
        would start it at the next step, after that step's rollout came in on every worker. Its requests queue
        behind the rollouts in flight, so a worker that finishes its share of those early starts on it at once."""
        k = self.max_staleness
        if self.early_dispatch and k:  # steps step + 1 .. step + K are in flight since ``run_ahead``
            self._start_ahead(record.step + k, upcoming[k : k + 1], self._dispatched)

    def _start_ahead(self, step: int, upcoming: Sequence[list[Prompt]], timer: StageTimer) -> None:
        """Start the rollouts of steps ``step + 1``, ``step + 2``, ... (``upcoming``) that are not in flight yet."""
        for offset, prompts in enumerate(upcoming, start=1):
            ahead = step + offset
            self._take_resumed(ahead, prompts)
            if ahead not in self._ahead and prompts:
                job = self._job(prompts + self._draw_extra(len(prompts)), timer, seed=self._seed(ahead, 0))
                self._ahead[ahead] = (job, self.placement.start_rollout(job))

    def _draw_extra(self, target: int) -> list[Prompt]:
        """``oversample``: the extra prompts a rollout of ``target`` prompts starts with, so that its kept groups fill
        the share at the last step's keep rate (``prompts_to_draw``); none without dynamic sampling or before the
        first step's filter."""
        if not self._oversampling or self.keep_rate is None or self.keep_rate >= 1.0 or not target:
            return []  # (no target: a controller with no prompts this step)
        assert self.draw_prompts is not None  # ``_oversampling``
        return self.draw_prompts(prompts_to_draw(target, self.keep_rate) - target)

    @property
    def _oversampling(self) -> bool:
        """``oversample`` has something to draw: dynamic sampling that re-samples."""
        return self.oversample and self.draw_prompts is not None and self.algorithm.max_rounds > 1

    # -- the rollouts in flight in a checkpoint ---------------------------------------------------
    def in_flight_state(self) -> list[dict]:
        """What a checkpoint records of the rollouts in flight (started ahead, not yet collected), as plain data
        (no objects): for each, its step, the prompts (their indices), the policy version and seed it was started
        with, and what a resumed run needs to collect the same samples (``InFlight``): the engine's outputs
        (token ids, log-probabilities, whether each response finished), waited for here when the placement can
        give them; else whether starting it again reproduces it (``deferred``). A rollout with neither is
        recorded without them: the resumed run generates it again, with the weights resumed."""
        records = []
        for step, (job, result) in sorted(self._ahead.items()):
            entry: dict = {"step": step, "prompts": [p.index for p in job.prompts], "version": job.policy_version,
                           "seed": job.seed, "deferred": result.deferred}
            if result.generations is not None:
                entry.update(_pack(result.generations()))
            records.append(entry)
        return records

    def load_in_flight(self, records: list[dict]) -> None:
        """Take the rollouts in flight a checkpoint recorded (``in_flight_state``); each is taken up by the step
        that collects it or would start it, for the same prompts (``_take_resumed``)."""
        self._resumed = {int(entry["step"]): entry for entry in records}

    def not_reproduced(self) -> int:
        """How many of the rollouts in flight that the checkpoint recorded a resumed run must generate again,
        with the current weights (neither their outputs nor ``deferred`` recorded)."""
        return sum(1 for entry in self._resumed.values() if "tokens" not in entry and not entry["deferred"])

    def _take_resumed(self, step: int, prompts: list[Prompt]) -> None:
        """A rollout for ``step`` that the checkpoint recorded becomes the rollout in flight for ``step``, as the
        uninterrupted run had it: finished from its recorded outputs (``placement.resume_rollout``), or started
        again when nothing of it had run (``deferred``), with the policy version and seed it was started with.
        One recorded for other prompts (a resume on another number of controllers deals them out anew), or
        with neither, is dropped: it is generated again with the weights resumed (collected now, or started
        ahead by ``run_ahead``)."""
        entry = self._resumed.pop(step, None)
        recorded = [int(i) for i in entry["prompts"]] if entry is not None else []
        if entry is None or step in self._ahead or [p.index for p in prompts] != recorded[: len(prompts)]:
            return
        extra = recorded[len(prompts) :]  # ``oversample``'s extra prompts, drawn when it started
        if extra:
            if self.prompts_at is None:
                return
            prompts = prompts + self.prompts_at(extra)
        job = self._job(prompts, StageTimer(), seed=entry["seed"], version=int(entry["version"]))
        if "tokens" in entry:
            self._ahead[step] = (job, self.placement.resume_rollout(job, _unpack(entry)))
        elif entry["deferred"]:
            self._ahead[step] = (job, self.placement.start_rollout(job))

    def _seed(self, step: int, call: int) -> int:
        return rollout_seed(self.seed, self.fabric.global_rank, step, call)

    def prepare(self, record: StepRecord) -> RolloutBatch:
        """PREPARE: the padded batch, the log-probabilities and values the loss needs, advantages."""
        if self.max_staleness:  # the strict bound (``_bound_staleness``): no sample trained older than K
            oldest = max((staleness(s, record.step) for s in record.kept), default=0)
            if oldest > self.max_staleness:
                raise RuntimeError(f"step {record.step}: a sample {oldest} versions old would be trained "
                                   f"(--trainer.max_staleness {self.max_staleness})")
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
        updates = self.placement.update(Telemetry(record.step, per_rank, record.judge_scale))
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
        if self.max_staleness:
            metrics.update(self._staleness_metrics(record))
        if self.env is not None and self.env.multi_turn:
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
        batch.response_mask = self.algorithm.loss_mask(batch)
        if self.max_staleness:
            batch.behaviour_logprobs = batch.engine_logprobs
            batch.policy_versions = torch.tensor([s.policy_version for s in kept or samples[:1]], dtype=torch.long)
        return batch

    def _staleness_metrics(self, record: StepRecord) -> dict[str, float]:
        """How many versions old the trained samples were (``staleness``), over every rank, the samples
        generated again because they would have been older than ``max_staleness``, and the slowest
        controller's wait for its rollout to come in."""
        ages = torch.tensor([float(staleness(s, record.step)) for s in record.kept], dtype=torch.float64)
        sums = self._all_reduce(torch.tensor([ages.sum(), len(ages), record.regenerated_stale], dtype=torch.float64),
                                "sum")
        most = self._all_reduce(torch.tensor([ages.max() if len(ages) else 0.0, record.rollout_wait_s],
                                             dtype=torch.float64), "max")
        metrics = {"async/staleness_mean": float(sums[0] / sums[1].clamp(min=1.0)),
                   "async/staleness_max": float(most[0]), "async/rollout_wait_s": float(most[1]),
                   "async/regenerated_stale": float(sums[2])}
        if self.partial_rollouts:  # how many samples a weight update cut, and their tokens' mean staleness
            spans = [s.token_versions for s in record.kept if s.token_versions and len(set(s.token_versions)) > 1]
            tokens = [record.step - v for s in record.kept for v in (s.token_versions or
                                                                     [s.policy_version] * len(s.response_ids))]
            counts = self._all_reduce(torch.tensor([len(spans), sum(tokens), len(tokens)], dtype=torch.float64), "sum")
            metrics["async/partial_samples"] = float(counts[0])
            metrics["async/token_staleness_mean"] = float(counts[1] / counts[2].clamp(min=1.0))
        return metrics

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


def next_round(target: int, kept: int, drawn: int) -> int:
    """How many prompts dynamic sampling's next round draws when ``kept`` of the ``drawn`` groups so far were kept
    and ``target`` are needed: the shortfall over the keep rate seen (at worst one group in all), at most 4x
    ``target``."""
    keep_rate = max(kept / drawn, 1.0 / drawn)
    return min(math.ceil((target - kept) / keep_rate), 4 * target)


def prompts_to_draw(target: int, keep_rate: float, confidence: float = 0.9) -> int:
    """How many prompts a rollout starts with (``--trainer.oversample``) so that, each group kept with probability
    ``keep_rate``, at least ``target`` groups are kept with probability ``confidence`` (the normal approximation of
    the binomial, with continuity correction); between ``target`` and 5x ``target`` (``filter``'s most)."""
    if keep_rate >= 1.0 or target <= 0:
        return max(target, 0)
    if keep_rate <= 0.0:
        return 5 * target
    z = statistics.NormalDist().inv_cdf(confidence)
    spread = z * math.sqrt(keep_rate * (1.0 - keep_rate))
    root = (spread + math.sqrt(spread**2 + 4.0 * keep_rate * (target - 0.5))) / (2.0 * keep_rate)
    return min(max(target, math.ceil(root**2)), 5 * target)


def staleness(sample: Sample, step: int) -> int:
    """How many versions old ``sample`` is when trained at ``step``: ``step`` minus the oldest version that
    sampled any of its tokens. A sample is generated by one version today (``Sample.policy_version``, the
    version its request was sent with; a worker can only have newer weights by then); with partial rollouts
    its later tokens may come from newer versions (``Sample.token_versions``), never older ones, so the oldest is
    still ``policy_version``."""
    return step - sample.policy_version


def _pack(outputs: list[list[Generation]]) -> dict[str, object]:
    """An engine's outputs (one list of generations per prompt) as tensors, for a checkpoint (``rank_<r>.pt``,
    loaded with ``weights_only=True``): every response's token ids and log-probabilities (float64: as the engine
    gave them) one after another, with their lengths, whether each finished, and how many responses each prompt
    has."""
    flat = [g for group in outputs for g in group]
    return {"counts": [len(group) for group in outputs],
            "lengths": torch.tensor([len(g.token_ids) for g in flat], dtype=torch.long),
            "logprob_lengths": torch.tensor([len(g.logprobs) for g in flat], dtype=torch.long),
            "tokens": torch.tensor([t for g in flat for t in g.token_ids], dtype=torch.long),
            "logprobs": torch.tensor([x for g in flat for x in g.logprobs], dtype=torch.float64),
            "finished": torch.tensor([g.finished for g in flat], dtype=torch.bool),
            # partial rollouts: how many weight updates came before each token (0 where none did)
            "versions": torch.tensor([v for g in flat for v in (g.versions or [0] * len(g.token_ids))],
                                     dtype=torch.long)}


def _unpack(entry: dict) -> list[list[Generation]]:
    """``_pack``'s outputs back."""
    lengths = entry["lengths"].tolist()
    tokens = entry["tokens"].split(lengths)
    logprobs = entry["logprobs"].split(entry["logprob_lengths"].tolist())
    versions = entry["versions"].split(lengths) if "versions" in entry else [None] * len(lengths)
    flat = [Generation(t.tolist(), lp.tolist(), bool(f), v.tolist() if v is not None and bool(v.any()) else None)
            for t, lp, f, v in zip(tokens, logprobs, entry["finished"].tolist(), versions, strict=True)]
    out, start = [], 0
    for count in entry["counts"]:
        out.append(flat[start : start + count])
        start += count
    return out


def rollout_seed(seed: int, rank: int, step: int, call: int) -> int:
    """The seed the ``call``-th rollout of ``step`` on controller ``rank`` samples from on engine workers
    (``RolloutJob.seed``): a hash of the four, below 2**62 (a worker adds the request's index)."""
    digest = hashlib.sha256(f"gcore-rollout/{seed}/{rank}/{step}/{call}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


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
