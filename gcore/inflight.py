"""The rollouts that run ahead of their step (``--trainer.max_staleness``, docs/asynchronous.md).

``InFlightRollouts`` holds the one queue of the steps drawn ahead: each step's prompts, drawn from the
global prompt stream up to K steps early (one more with ``--trainer.dispatch device``), and, once it
is started, the rollout in flight for it. It draws (``draw``), starts the rollouts of the next K steps
while a step trains (``run_ahead``) and the one after them as soon as its weights exist
(``dispatch``), hands each step the rollout started for it (``collect``), bounds its staleness
(``bound_staleness``), says how much judging the next rollout has for the placement's look-ahead
(``judge_scale``), and is one part of a checkpoint (``state_dict``/``load_state_dict``, ``resume``).
With K = 0 the queue has depth 0: every step draws its own prompts and generates them in ``collect``'s
caller, the synchronous step.

The pure scheduling arithmetic is here too (``next_round``, ``prompts_to_draw``, ``staleness``,
``rollout_seed``): ``gcore simulate`` models the same schedule with it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gcore.errors import ConfigError
from gcore.rollout import RolloutJob, StageTimer
from gcore.types import Generation, Prompt, Sample

if TYPE_CHECKING:
    from gcore.algorithms.base import Algorithm
    from gcore.data import PromptSampler
    from gcore.engines.base import Engine
    from gcore.placement.base import InFlight, PlacementPolicy
    from gcore.rewards.base import RewardModel

log = logging.getLogger(__name__)


class MakeJob(Protocol):
    """The controller's ``RolloutJob`` for ``prompts`` (``version`` ``None``: the weights the engine has now)."""

    def __call__(self, prompts: list[Prompt], timer: StageTimer, first_group: int = 0, seed: int | None = None,
                 version: int | None = None) -> RolloutJob: ...


@dataclass
class Drawn:
    """One step's prompts, drawn from the global prompt stream (``draw``), and the rollout in flight for it."""

    step: int
    batch: list[int]  # the step's global batch (prompt indices), the same on every controller
    shard: list[int]  # this controller's share of it
    imbalance: float  # the share's predicted imbalance over the controllers (``balance/predicted_imbalance``)
    prompts: list[Prompt]  # the shard's prompts
    #: the rollout started ahead for this step (``run_ahead``, ``dispatch`` or a resume), until ``collect``
    rollout: tuple[RolloutJob, InFlight] | None = None


@dataclass
class Collected:
    """A rollout started ahead, collected by its step: its job (what it timed and counted), its samples and the
    seconds the step waited for them."""

    job: RolloutJob
    samples: list[Sample]
    wait_s: float


class InFlightRollouts:
    """The steps drawn ahead and their rollouts in flight, on one controller.

    Args:
        max_staleness: K (``--trainer.max_staleness``): the rollouts of the next K steps run while a step trains;
            0: the synchronous step.
        early_dispatch: ``--trainer.dispatch device``: the rollout of step ``s + K + 1`` starts as soon as step
            ``s`` synced (``dispatch``), not when step ``s + 1`` starts training (``run_ahead``).
        partial: ``--trainer.partial_rollouts``: a weight update stops the generation in flight between tokens.
        oversample: ``--trainer.oversample``: each rollout starts with the extra prompts the last step's keep rate
            says its share will need (dynamic sampling).
        seed: the run's seed; each rollout samples from ``rollout_seed(seed, rank, step, call)``.
        max_steps: the run's last step + 1: nothing is drawn beyond it.
        sampler: the global prompt stream (``None``: ``draw`` is not used, as in a controller built alone).
        take: prompt indices -> prompts.
        draw_prompts: ``k`` more prompts of this controller's own stream (dynamic sampling, ``oversample``).
        reward: the reward model, whose judged prompts ``judge_scale`` counts.
    """

    def __init__(self, max_staleness: int = 0, *, early_dispatch: bool = False, partial: bool = False,
                 oversample: bool = False, seed: int = 0, max_steps: int = 0, sampler: PromptSampler | None = None,
                 take: Callable[[list[int]], list[Prompt]] | None = None,
                 draw_prompts: Callable[[int], list[Prompt]] | None = None, reward: RewardModel | None = None) -> None:
        self.max_staleness, self.early_dispatch, self.partial = max_staleness, early_dispatch, partial
        self.oversample, self.seed, self.max_steps = oversample, seed, max_steps
        self.sampler, self.take, self.draw_prompts, self.reward = sampler, take, draw_prompts, reward
        #: the steps drawn: this step's (first, until the next ``draw``) and those drawn ahead of it
        self.queue: list[Drawn] = []
        #: the queue's depth beyond this step: K, and with early dispatch the one after them
        self.depth = max_staleness + (1 if max_staleness and early_dispatch else 0)
        #: groups kept / groups sampled at the last step's filter (``oversample``); ``None`` before the first
        self.keep_rate: float | None = None
        #: what starting a rollout in ``dispatch`` timed (a swap of partitions): added to the next step's times
        self.dispatched = StageTimer()
        #: step -> a rollout in flight the checkpoint recorded, taken up by the step that collects or starts it
        self._resumed: dict[int, dict] = {}
        self._loaded: dict[str, Any] = {}  # ``load_state_dict``'s state, until ``resume``
        self._placement: PlacementPolicy | None = None
        self._job: MakeJob | None = None
        self._rank, self._world_size, self._max_rounds = 0, 1, 1

    def setup(self, placement: PlacementPolicy, make_job: MakeJob, rank: int, world_size: int,
              max_rounds: int = 1) -> None:
        """Called by the controller before the first step: the placement that runs the rollouts, the controller's
        job factory, its rank and count, and the algorithm's ``max_rounds`` (dynamic sampling). With K >= 1 the
        placement is told that rollouts will run while the controller trains."""
        self._placement, self._job = placement, make_job
        self._rank, self._world_size, self._max_rounds = rank, world_size, max_rounds
        if self.max_staleness:
            if not placement.supports_overlap:
                raise ConfigError(f"--trainer.max_staleness {self.max_staleness}: {type(placement).__name__} "
                                  "runs no rollout while the controller trains")
            placement.allow_overlap(partial=self.partial)

    # -- the queue ------------------------------------------------------------------------------
    def draw(self, step: int) -> Drawn:
        """This step's prompts: the global batches of this step and the next ``depth`` are drawn (those not drawn
        yet, none beyond the run's last step), and this step's comes off the queue's front."""
        assert self.sampler is not None and self.take is not None, "draw needs the prompt stream"
        if self.queue and self.queue[0].step < step:
            self.queue.pop(0)  # the step before, collected
        while len(self.queue) <= self.depth and step + len(self.queue) < self.max_steps:
            batch = self.sampler.next_global()
            shard = self.sampler.shard(batch)
            self.queue.append(Drawn(step + len(self.queue), batch, shard, self.sampler.last_imbalance,
                                    self.take(shard)))
        return self.queue[0]

    @property
    def ahead(self) -> list[Drawn]:
        """The steps drawn ahead of this one."""
        return self.queue[1:]

    def collect(self, step: int, timer: StageTimer) -> Collected | None:
        """The rollout started ahead for ``step`` (or recorded for it by the checkpoint resumed from), waited for,
        with its stage times in ``timer``; ``None`` when there is none: the step generates its prompts now."""
        current = self._entry(step)
        if current is not None:
            self._take_resumed(current)
        if current is None or current.rollout is None:
            return None
        job, result = current.rollout
        current.rollout = None
        job.timer = timer
        started = time.perf_counter()
        samples = result()
        return Collected(job, samples, time.perf_counter() - started)

    def run_ahead(self, step: int, timer: StageTimer) -> None:
        """Start the rollouts of steps ``step + 1 .. step + K`` not in flight yet, with the weights the engine has
        now: they generate while ``step`` trains (the weight update after it queues behind them)."""
        for drawn in self.ahead[: self.max_staleness]:
            self._start(drawn, timer)

    def dispatch(self, step: int) -> None:
        """With early dispatch: start the rollout of step ``step + K + 1`` now that ``step``'s weights are synced,
        the version it may be generated with; its requests queue behind the rollouts in flight, so a worker that
        finishes its share of those early starts on it at once."""
        k = self.max_staleness
        if self.early_dispatch and k:  # steps step + 1 .. step + K are in flight since ``run_ahead``
            for drawn in self.ahead[k : k + 1]:
                self._start(drawn, self.dispatched)

    def take_dispatched(self) -> StageTimer:
        """What ``dispatch`` timed since the last call, for the next step's stage times."""
        dispatched, self.dispatched = self.dispatched, StageTimer()
        return dispatched

    def _start(self, drawn: Drawn, timer: StageTimer) -> None:
        self._take_resumed(drawn)
        if drawn.rollout is None and drawn.prompts:
            assert self._job is not None and self._placement is not None  # ``setup``
            job = self._job(drawn.prompts + self.extra_prompts(len(drawn.prompts)), timer,
                            seed=self.rollout_seed(drawn.step, 0))
            drawn.rollout = (job, self._placement.start_rollout(job))

    def _entry(self, step: int) -> Drawn | None:
        return next((drawn for drawn in self.queue if drawn.step == step), None)

    # -- what a rollout is made of --------------------------------------------------------------
    def rollout_seed(self, step: int, call: int) -> int:
        """The seed of this controller's ``call``-th rollout of ``step`` (``rollout_seed``)."""
        return rollout_seed(self.seed, self._rank, step, call)

    @property
    def oversampling(self) -> bool:
        """``oversample`` has something to draw: dynamic sampling that re-samples."""
        return self.oversample and self.draw_prompts is not None and self._max_rounds > 1

    def extra_prompts(self, target: int) -> list[Prompt]:
        """``oversample``: the extra prompts a rollout of ``target`` prompts starts with, so that its kept groups fill
        the share at the last step's keep rate (``prompts_to_draw``); none without dynamic sampling or before the
        first step's filter."""
        if not self.oversampling or self.keep_rate is None or self.keep_rate >= 1.0 or not target:
            return []  # (no target: a controller with no prompts this step)
        assert self.draw_prompts is not None  # ``oversampling``
        return self.draw_prompts(prompts_to_draw(target, self.keep_rate) - target)

    def kept(self, groups_accepted: int, groups_sampled: int) -> None:
        """The last step's filter kept ``groups_accepted`` of ``groups_sampled`` groups (the keep rate ``extra_prompts``
        draws for)."""
        if self.oversampling and groups_sampled:
            self.keep_rate = groups_accepted / groups_sampled

    # -- the bound ------------------------------------------------------------------------------
    def bound_staleness(self, step: int, samples: list[Sample],
                        regenerate: Callable[[list[Prompt]], list[Sample]]) -> tuple[list[Sample], int]:
        """The strict bound of ``max_staleness`` K: a group with a sample that would be trained more than K versions
        old at ``step`` (``staleness``) is thrown away and generated again now (``regenerate``, with the current
        weights), for the same prompt and under the same group number. Returns the samples and how many were
        generated again (``async/regenerated_stale``). The pipeline keeps every sample within K; this catches
        whatever did not (a rollout that came in later than planned, a placement that recorded an older version)."""
        limit = self.max_staleness
        stale = sorted({s.group for s in samples if staleness(s, step) > limit})
        if not stale:
            return samples, 0
        members = {group: [s for s in samples if s.group == group] for group in stale}
        fresh = regenerate([members[group][0].prompt for group in stale])
        regenerated: dict[int, list[Sample]] = {group: [] for group in stale}
        for sample in fresh:  # numbered 0, 1, ... in the order of ``stale``: back to the groups they replace
            sample.group = stale[sample.group]
            regenerated[sample.group].append(sample)
        count = sum(len(m) for m in members.values())
        log.warning("step %d: %d sample(s) in %d group(s) would have been trained more than %d version(s) old "
                    "(--trainer.max_staleness): generated again with the current weights (async/regenerated_stale)",
                    step, count, len(stale), limit)
        out: list[Sample] = []
        done: set[int] = set()
        for sample in samples:  # the groups in their order, the stale ones replaced
            if sample.group not in regenerated:
                out.append(sample)
            elif sample.group not in done:
                out.extend(regenerated[sample.group])
                done.add(sample.group)
        return out, count

    def check_staleness(self, step: int, kept: list[Sample]) -> None:
        """Raise when a sample to be trained at ``step`` is older than K (``bound_staleness`` prevents it)."""
        oldest = max((staleness(s, step) for s in kept), default=0)
        if self.max_staleness and oldest > self.max_staleness:
            raise RuntimeError(f"step {step}: a sample {oldest} versions old would be trained "
                               f"(--trainer.max_staleness {self.max_staleness})")

    def staleness_metrics(self, step: int, kept: list[Sample], regenerated: int, wait_s: float,
                          all_reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> dict[str, float]:
        """How many versions old the samples trained at ``step`` were (``staleness``), over every rank
        (``all_reduce``), the samples generated again because they would have been older than K, and the slowest
        controller's wait for its rollout to come in."""
        ages = torch.tensor([float(staleness(s, step)) for s in kept], dtype=torch.float64)
        sums = all_reduce(torch.tensor([ages.sum(), len(ages), regenerated], dtype=torch.float64), "sum")
        most = all_reduce(torch.tensor([ages.max() if len(ages) else 0.0, wait_s], dtype=torch.float64), "max")
        metrics = {"async/staleness_mean": float(sums[0] / sums[1].clamp(min=1.0)),
                   "async/staleness_max": float(most[0]), "async/rollout_wait_s": float(most[1]),
                   "async/regenerated_stale": float(sums[2])}
        if self.partial:  # how many samples a weight update cut, and their tokens' mean staleness
            spans = [s.token_versions for s in kept if s.token_versions and len(set(s.token_versions)) > 1]
            tokens = [step - v for s in kept for v in (s.token_versions or [s.policy_version] * len(s.response_ids))]
            counts = all_reduce(torch.tensor([len(spans), sum(tokens), len(tokens)], dtype=torch.float64), "sum")
            metrics["async/partial_samples"] = float(counts[0])
            metrics["async/token_staleness_mean"] = float(counts[1] / counts[2].clamp(min=1.0))
        return metrics

    # -- the placement's look-ahead -------------------------------------------------------------
    def judge_scale(self, step: int) -> float:
        """The judged prompts (``RewardModel.judged``) of the rollout that starts after ``step`` (step + K + 1's
        global batch) over those of ``step``'s: the same on every controller (``Telemetry.judge_scale``, for the
        placement's split). 1 without a judge, when ``step`` judges nothing (no cost to scale), or when no
        rollout starts after ``step`` in this run."""
        reward, k = self.reward, self.max_staleness
        current = self._entry(step)
        if (reward is None or self.sampler is None or self.take is None or current is None or not reward.judges()
                or step + k + 1 >= self.max_steps):
            return 1.0
        judged_now = sum(map(reward.judged, self.take(current.batch)))
        # step + K + 1's batch: drawn already where it is dispatched early, else the next one to draw
        ahead = self.ahead
        following = ahead[k].batch if len(ahead) > k else self.sampler.peek_global()
        judged_next = sum(map(reward.judged, self.take(following)))
        return judged_next / judged_now if judged_now else 1.0

    # -- in a checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Two halves (``Checkpointer``'s split part): ``shared`` (every controller alike, in
        ``trainer_state.json``), the global batches drawn ahead with their predicted imbalance; ``own``
        (``rank_<r>.pt``), this controller's shards of them, its rollouts in flight (``in_flight_state``) and
        the keep rate."""
        ahead = self.ahead
        return {"shared": {"max_staleness": self.max_staleness,
                           "batches": [{"batch": d.batch, "imbalance": d.imbalance} for d in ahead]},
                "own": {"world_size": self._world_size, "shards": [d.shard for d in ahead],
                        "rollouts": self.in_flight_state(), "keep_rate": self.keep_rate}}

    def load_state_dict(self, state: dict) -> None:
        """Keep what a checkpoint recorded (``state_dict``'s halves; ``own`` ``None`` where this rank has none), for
        ``resume``."""
        self._loaded = state

    def resume(self, step: int) -> list[str]:
        """After the checkpoint is loaded, before ``step`` (the first step the run resumes at): the batches drawn
        ahead, dealt out as they were (on another number of controllers, anew), and the rollouts in flight taken
        up by the steps that collect them; returns the notes on what the resumed run cannot reproduce of the
        uninterrupted one."""
        assert self.sampler is not None and self.take is not None, "resume needs the prompt stream"
        drawn: dict[str, Any] = self._loaded.get("shared") or {}
        own = self._loaded.get("own")
        notes = []
        if own is not None and own.get("world_size") != self._world_size:
            own = None  # another number of controllers: the shards and the rollouts in flight are dealt out anew
        if own is None and drawn.get("batches"):
            notes.append("the checkpoint was written by another number of controllers: the prompts drawn ahead are "
                         "dealt out anew and generated again, with the weights resumed")
        self.queue = []
        for i, entry in enumerate(drawn.get("batches", [])):
            batch = [int(x) for x in entry["batch"]]
            shard = [int(x) for x in own["shards"][i]] if own is not None else self.sampler.shard(batch)
            self.queue.append(Drawn(step + i, batch, shard, float(entry["imbalance"]), self.take(shard)))
        if own is not None:
            self._resumed = {int(entry["step"]): entry for entry in own["rollouts"]}
            self.keep_rate = own.get("keep_rate")  # how many extra prompts the next rollouts draw
        again = sum(1 for entry in self._resumed.values() if "tokens" not in entry and not entry["deferred"])
        if again:
            notes.append(f"{again} rollout(s) in flight at the checkpoint could not be recorded (they ran in a "
                         "thread, with a generative judge or multi-turn episodes, the placement gives no record "
                         "of them, or partial rollouts were on: a checkpoint does not wait for their generation): "
                         "they are generated again, with the weights resumed")
        if self.max_staleness and drawn.get("max_staleness") and not drawn.get("batches"):
            notes.append("the checkpoint was written at the last step of its run, with no rollout in flight: the "
                         "pipeline starts afresh (the first step generates now, as step 0 does)")
        placement = self._placement
        if self.max_staleness and placement is not None and not placement.reproducible:
            notes.append(f"{type(placement).__name__} does not sample the same on every run (its split of "
                         "the workers follows measured times): the rollouts in flight are collected as recorded, "
                         "but the resumed run is not an exact continuation")
        if self.partial:
            notes.append("partial rollouts continue across a weight update from wherever it stopped them (a "
                         "matter of timing): the resumed run is not an exact continuation")
        return notes

    def in_flight_state(self) -> list[dict]:
        """What a checkpoint records of the rollouts in flight (started ahead, not yet collected), as plain data
        (no objects): for each, its step, the prompts (their indices), the policy version and seed it was started
        with, and what a resumed run needs to collect the same samples (``InFlight``): the engine's outputs
        (token ids, log-probabilities, whether each response finished), waited for here when the placement can
        give them and partial rollouts are off; else whether starting it again reproduces it (``deferred``). A
        rollout with neither is recorded without them: the resumed run generates it again, with the weights
        resumed. With partial rollouts the generation in flight is not waited for (the checkpoint would join it, and
        the next weight update would have nothing to cut): a resumed run generates those rollouts again."""
        records = []
        for drawn in self.queue:
            if drawn.rollout is None:
                continue
            job, result = drawn.rollout
            entry: dict = {"step": drawn.step, "prompts": [p.index for p in job.prompts],
                           "version": job.policy_version, "seed": job.seed,
                           "deferred": result.deferred}
            # with partial rollouts the generation in flight is not waited for: joining it here would let it finish
            # with the weights it has, and the next update would find nothing to cut (docs/asynchronous.md);
            # a resumed run generates it again (as it does when a placement gives no record)
            if result.generations is not None and not self.partial:
                entry.update(pack(result.generations()))
            records.append(entry)
        return records

    def _take_resumed(self, drawn: Drawn) -> None:
        """A rollout for ``drawn``'s step that the checkpoint recorded becomes its rollout in flight, as the
        uninterrupted run had it: finished from its recorded outputs (``placement.resume_rollout``), or started
        again when nothing of it had run (``deferred``), with the policy version and seed it was started with.
        One recorded for other prompts (a resume on another number of controllers deals them out anew), or
        with neither, is dropped: it is generated again with the weights resumed (collected now, or started
        ahead by ``run_ahead``)."""
        entry = self._resumed.pop(drawn.step, None)
        recorded = [int(i) for i in entry["prompts"]] if entry is not None else []
        prompts = drawn.prompts
        if entry is None or drawn.rollout is not None or [p.index for p in prompts] != recorded[: len(prompts)]:
            return
        extra = recorded[len(prompts) :]  # ``oversample``'s extra prompts, drawn when it started
        if extra:
            if self.take is None:
                return
            prompts = prompts + self.take(extra)
        assert self._job is not None and self._placement is not None  # ``setup``
        job = self._job(prompts, StageTimer(), seed=entry["seed"], version=int(entry["version"]))
        if "tokens" in entry:
            drawn.rollout = (job, self._placement.resume_rollout(job, unpack(entry)))
        elif entry["deferred"]:
            drawn.rollout = (job, self._placement.start_rollout(job))


def check_options(max_staleness: int, partial: bool, oversample: bool, placement: PlacementPolicy, engine: Engine,
                  algorithm: Algorithm) -> None:
    """A one-line ``ConfigError`` when the plugins cannot run the rollouts ahead that the options ask for; the
    trainer calls it before anything is launched."""
    if max_staleness and not placement.supports_overlap:
        raise ConfigError(f"--trainer.max_staleness {max_staleness} needs engine worker processes to generate "
                          f"while the controller trains: --placement dynamic, or --placement static with "
                          f"--placement.workers N; {type(placement).__name__} here runs its engine in the "
                          "controller's process")
    if partial and not engine.capabilities.interrupt:
        raise ConfigError(f"--trainer.partial_rollouts true: the {type(engine).__name__} engine cannot stop "
                          "between tokens for a weight update (EngineCapabilities.interrupt); use --engine hf with "
                          "--engine.use_generate false, or --engine vllm without --engine.separate_process")
    if oversample and algorithm.max_rounds <= 1:
        raise ConfigError(f"--trainer.oversample true draws dynamic sampling's extra prompts up front: the "
                          f"{type(algorithm).__name__} algorithm draws none (max_rounds "
                          f"{algorithm.max_rounds}); use --algorithm dapo (dynamic_sampling, max_rounds > 1)")


# -- the schedule's arithmetic (``gcore simulate`` models the same) --------------------------------

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


def rollout_seed(seed: int, rank: int, step: int, call: int) -> int:
    """The seed the ``call``-th rollout of ``step`` on controller ``rank`` samples from on engine workers
    (``RolloutJob.seed``): a hash of the four, below 2**62 (a worker adds the request's index)."""
    digest = hashlib.sha256(f"gcore-rollout/{seed}/{rank}/{step}/{call}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


# -- the rollouts in flight as tensors ---------------------------------------------------------------

def pack(outputs: list[list[Generation]]) -> dict[str, object]:
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


def unpack(entry: dict) -> list[list[Generation]]:
    """``pack``'s outputs back."""
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
