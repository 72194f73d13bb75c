"""Asynchronous training in the simulator: bounded staleness ``K`` and partial rollouts.

With ``K >= 1`` (one-step-off and fully asynchronous pipelines: NeMo-RL, verl, AReaL, slime) the
devices keep their roles for the whole run: ``train_devices`` train, the others hold the policy's
engine (``generate``) or the judge's (``judge``), split by ``DynamicPlacement`` as in the
synchronous loop. Nothing swaps; after every training step the new weights are loaded into each
generation engine before its next share of samples (one ``swap_s`` on that device: an assumption,
the same estimate as an engine swap).

A generation device serves its share of every batch in turn (the samples are dealt round-robin, as
the trainer's controllers hold their own prompts), without waiting for the other devices: it may
start batch ``b`` as soon as policy version ``b - K`` exists (version ``v``: the weights after
``v`` training steps), and loads the newest version there is when it starts. So every sample is
trained on at most ``K`` versions after the one that wrote its first token. ``K = 0`` is the
synchronous loop of ``model.simulate``, which this module does not replace.

Partial rollouts (``partial_budget`` tokens): within one share a response generates at most the
budget; the rest is paused at the share's end and continued in the same device's share of the next
batch, after the weight load (its prompt and the tokens so far are read again at ``prefill_token_s``), and the
sample is trained on in the step in which it ends. A response is paused only when that keeps its
staleness within ``K``: the budget bounds the tail of a share exactly where it would hold a step up
(a device that starts late starts with fresh weights), and nowhere else.

Re-sampling (``resample_fraction``) stays local to a generation device, as in the trainer: a device
draws its second round of batch ``b`` once its own first-round samples have verdicts. The judge
serves older batches first. The training partition is sized once, from the first batch: its share
of the devices is training's share of the work (device-seconds of training, generation and judging,
as the synchronous loop would spend them), rounded up. The placement policy reads each batch's
telemetry when the batch is done; its decision applies from batch ``b + K + 1``, the first that
cannot have started yet.

Accounting: a step's time is the time between two training steps' ends; busy and idle are counted
per device in that window (busy intervals clipped to it), so busy + idle = devices x step time.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gcore.errors import ConfigError
from gcore.placement import DynamicPlacement, Telemetry
from gcore.simulator.model import (
    StepResult,
    Workload,
    generation_costs,
    judge_costs,
    judge_each,
    record,
    response_lengths,
    rollout_static,
    serve,
)

Intervals = list[tuple[float, float]]


@dataclass
class Response:
    """A response being generated: ``done`` of its ``length`` tokens so far, the first with ``version``."""

    length: int
    version: int = -1
    done: int = 0


@dataclass
class Device:
    """A rollout device: its role, when it is free, the weights its engine holds, and its time line."""

    role: str = ""
    free: float = 0.0
    version: int = 0
    busy: dict[str, Intervals] = field(default_factory=lambda: {"generate": [], "judge": []})
    swap: Intervals = field(default_factory=list)


def draw_batches(work: Workload, devices: int, steps: int, seed: int) -> list[list[list[int]]]:
    """Every step's rounds of response lengths, drawn in the order ``model.simulate`` draws them."""
    rng = random.Random(seed)
    batches = []
    for step in range(steps):
        count = work.samples_per_device * devices
        rounds = [response_lengths(work, step, count, rng)]
        share = min(1.0, max(0.0, work.resample_fraction + work.resample_drift * step))
        if round(share * count):
            rounds.append(response_lengths(work, step, round(share * count), rng))
        batches.append(rounds)
    return batches


def size_training(work: Workload, devices: int, rounds: list[list[int]]) -> int:
    """Training's share of the devices: its share of the first batch's device-seconds, rounded up."""
    tokens = sum(rounds[0]) + work.prompt_tokens * len(rounds[0])
    train = devices * work.train_step_s + work.train_token_s * tokens
    rollout = 0.0
    for lengths in rounds:
        done = rollout_static(work, lengths, devices)
        rollout += sum(done.generate_busy) + sum(done.judge_busy)
    return min(devices - 2, max(1, math.ceil(devices * train / (train + rollout))))


def busy_before(intervals: Intervals, starts: list[float], total: list[float], t: float) -> float:
    """Busy seconds of sorted, disjoint ``intervals`` before time ``t`` (``starts``, ``total``: their
    starts and the running sums of their lengths)."""
    i = bisect.bisect_right(starts, t)
    if i == 0:
        return 0.0
    start, end = intervals[i - 1]
    return total[i - 1] - max(0.0, end - t)


def clipper(intervals: Intervals) -> Callable[[float, float], float]:
    """``window(a, b)``: the busy seconds of ``intervals`` between ``a`` and ``b``."""
    starts = [a for a, _ in intervals]
    total, running = [], 0.0
    for a, b in intervals:
        running += b - a
        total.append(running)
    return lambda a, b: busy_before(intervals, starts, total, b) - busy_before(intervals, starts, total, a)


@dataclass
class Batch:
    """What one batch's shares and verdicts leave behind."""

    index: int
    generate_devices: int
    judge_devices: int
    gate: float  # when version index - K exists: no share of this batch starts before
    longest: int = 0
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    generate_busy: list[float] = field(default_factory=list)
    judge_busy: list[float] = field(default_factory=list)
    staleness: Counter[int] = field(default_factory=Counter)
    consumed: list[int] = field(default_factory=list)  # lengths of the samples trained on
    verdicts: list[float] = field(default_factory=list)


class AsyncRun:
    """The devices, paused responses and training steps of one asynchronous run (see the module)."""

    def __init__(self, work: Workload, devices: int, max_staleness: int, partial_budget: int) -> None:
        self.work, self.k, self.budget = work, max_staleness, partial_budget
        self.costs = generation_costs(work)
        self.devices = [Device() for _ in range(devices)]
        self.carried: dict[int, list[Response]] = {}  # device -> its paused responses
        self.trained: list[float] = []  # when each training step ends: version v + 1 exists from trained[v] on

    def newest(self, at: float) -> int:
        """The newest policy version that exists at time ``at``."""
        return bisect.bisect_right(self.trained, at)

    def begin(self, index: int, g: int, j: int) -> Batch:
        """Gives the devices their roles for batch ``index`` (a device that changes role swaps engines)."""
        for i, device in enumerate(self.devices):
            role = "generate" if i < g else "judge"
            if device.role and device.role != role:
                record(device.swap, device.free, device.free + self.work.swap_s)
                device.free += self.work.swap_s
            device.role = role
        for i in [i for i in self.carried if i >= g]:  # a device that now judges hands its paused responses on
            self.carried.setdefault(i % g, []).extend(self.carried.pop(i))
        gate = self.trained[index - self.k - 1] if index - self.k - 1 >= 0 else 0.0
        return Batch(index, g, j, gate, generate_busy=[0.0] * g, judge_busy=[0.0] * j)

    def share(self, batch: Batch, d: int, items: list[Response], earliest: float) -> list[tuple[Response, float]]:
        """Device ``d`` serves ``items`` for ``batch`` from ``earliest`` on; the finished ones and when."""
        device, swap = self.devices[d], self.work.swap_s
        start = max(device.free, earliest, batch.gate)
        if self.newest(start) > device.version:  # load the newest weights first
            device.version = self.newest(start)
            record(device.swap, start, start + swap)
            start += swap
        segments = []
        for r in items:
            if r.version < 0:
                r.version = device.version
            pausable = self.budget > 0 and batch.index + 1 - r.version <= self.k
            segments.append(min(r.length - r.done, self.budget) if pausable else r.length - r.done)
        timeline: Intervals = []
        finish, busy = serve(
            [0.0] * len(items), segments, [self.work.prompt_tokens + r.done for r in items], self.costs, timeline
        )
        for a, e in timeline:
            record(device.busy["generate"], start + a, start + e)
        device.free = start + busy
        batch.generate_busy[d] += busy
        batch.starts.append(start)
        batch.ends.append(device.free)
        done = []
        for r, seconds, segment in zip(items, finish, segments, strict=True):
            batch.longest = max(batch.longest, segment)
            r.done += segment
            if r.done == r.length:
                done.append((r, start + seconds))
            else:
                self.carried.setdefault(d, []).append(r)
        return done

    def judge(self, batch: Batch, done: list[tuple[int, Response, float]]) -> list[float]:
        """Streams ``done`` (device, response, finished at) to the judge devices; the verdicts' times."""
        judges = self.devices[batch.generate_devices :]
        verdicts, busy, free = judge_each(
            self.work, [t for _, _, t in done], [r.length for _, r, _ in done], batch.judge_devices,
            [dv.free for dv in judges], [dv.busy["judge"] for dv in judges],
        )
        for d, (dv, t) in enumerate(zip(judges, free, strict=True)):
            dv.free = t
            batch.judge_busy[d] += busy[d]
        for _, r, _ in done:
            batch.staleness[batch.index - r.version] += 1
            batch.consumed.append(r.length)
        batch.verdicts += verdicts
        return verdicts

    def rollout(self, batch: Batch, rounds: list[list[int]]) -> float:
        """Generates and judges ``batch``; when it is complete (every device has reported its share)."""
        g = batch.generate_devices
        first = [
            (d, r, t) for d in range(g)
            for r, t in self.share(batch, d, self.carried.pop(d, []) + [Response(n) for n in rounds[0][d::g]], 0.0)
        ]
        verdicts = self.judge(batch, first)
        if len(rounds) > 1:  # each device re-samples once its own first-round samples have verdicts
            own = [0.0] * g
            for (d, _, _), t in zip(first, verdicts, strict=True):
                own[d] = max(own[d], t)
            second = [
                (d, r, t) for d in range(g)
                for r, t in self.share(batch, d, [Response(n) for n in rounds[1][d::g]], own[d])
            ]
            self.judge(batch, second)
        return max([*batch.verdicts, *batch.ends])


def simulate_async(
    policy: DynamicPlacement,
    devices: int,
    steps: int,
    work: Workload,
    seed: int = 0,
    max_staleness: int = 1,
    partial_budget: int = 0,
) -> list[StepResult]:
    """Runs ``steps`` training steps on ``devices`` devices with staleness ``max_staleness`` >= 1 and,
    when ``partial_budget`` > 0, partial rollouts of that many tokens per share (see the module)."""
    if not isinstance(policy, DynamicPlacement):
        raise ConfigError("max_staleness >= 1 needs the dynamic placement (roles that do not swap)")
    if max_staleness < 1:
        raise ConfigError(f"max_staleness {max_staleness}: the asynchronous model needs >= 1 (0: model.simulate)")
    if partial_budget < 0:
        raise ConfigError(f"partial rollout budget {partial_budget}: expected tokens >= 1 (0: off)")
    if devices < 4 or steps < 1:
        raise ConfigError("the asynchronous model needs devices >= 4 (train, generate, judge) and steps >= 1")
    batches = draw_batches(work, devices, steps, seed)
    train_devices = size_training(work, devices, batches[0])
    policy.setup(devices - train_devices, "simulated")
    run = AsyncRun(work, policy.total, max_staleness, partial_budget)
    split = {0: (policy.generate_devices, policy.judge_devices)}
    logs = []
    for b, rounds in enumerate(batches):
        batch = run.begin(b, *split[max(s for s in split if s <= b)])
        complete = run.rollout(batch, rounds)
        tokens = sum(length + work.prompt_tokens for length in batch.consumed)
        train_s = work.train_step_s + work.train_token_s * tokens / train_devices
        run.trained.append(max(complete, run.trained[-1] if run.trained else 0.0) + train_s)
        # the policy's telemetry for this batch, as the synchronous loop reports it; its decision applies
        # from the first batch that cannot have started yet
        rollout = complete - min(batch.starts)
        floor = serve([0.0], [batch.longest], [work.prompt_tokens], run.costs)[1]
        read = work.judge_prompt_tokens + work.prompt_tokens + max(batch.consumed, default=0)
        verdict = len(rounds) * serve([0.0], [work.judge_output_tokens], [read], judge_costs(work))[1]
        per_device = [{"generate": x, "generate_floor": floor, "rollout": rollout} for x in batch.generate_busy]
        per_device += [{"reward": x, "reward_floor": verdict, "rollout": rollout} for x in batch.judge_busy]
        policy.update(Telemetry(b, per_device))
        split[b + max_staleness + 1] = (policy.generate_devices, policy.judge_devices)
        stages = {"rollout": rollout, "generate": max(batch.ends) - min(batch.starts),
                  "judge": complete - max(batch.ends), "swap": work.swap_s, "train": train_s}
        logs.append((batch, stages, train_s))
    return account(run.devices, train_devices, run.trained, logs)


def account(
    devices: list[Device], train_devices: int, trained: list[float], logs: list[tuple[Batch, dict, float]]
) -> list[StepResult]:
    """Per step: busy and idle device-seconds per role between two training steps' ends."""
    windows = [(trained[b - 1] if b else 0.0, end) for b, end in enumerate(trained)]
    busy_in = [{role: clipper(dv.busy[role]) for role in ("generate", "judge")} for dv in devices]
    swap_in = [clipper(dv.swap) for dv in devices]
    results = []
    for (a, e), (batch, stages, train_s) in zip(windows, logs, strict=True):
        busy = {"generate": 0.0, "judge": 0.0, "train": train_devices * train_s}
        idle = {"generate": 0.0, "judge": 0.0, "train": train_devices * (e - a - train_s), "swap": 0.0}
        for i in range(len(devices)):
            worked = {role: busy_in[i][role](a, e) for role in ("generate", "judge")}
            swapped = swap_in[i](a, e)
            for role, seconds in worked.items():
                busy[role] += seconds
            idle["swap"] += swapped
            idle["generate" if i < batch.generate_devices else "judge"] += (e - a) - sum(worked.values()) - swapped
        results.append(StepResult(
            batch.index, e - a, batch.generate_devices, batch.judge_devices, idle, busy, stages,
            dict(batch.staleness), batch.longest, train_devices,
        ))
    return results
