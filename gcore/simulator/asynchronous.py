"""Asynchronous training in the simulator: bounded staleness ``K`` and partial rollouts.

With ``K >= 1`` (one-step-off and fully asynchronous pipelines: gcore's trainer, NeMo-RL, verl,
AReaL, slime) the devices keep their roles for the whole run: ``train_devices`` train, the others
hold the policy's engine (``generate``) or the judge's (``judge``), split by ``DynamicPlacement`` as
in the synchronous loop. Nothing swaps roles; a new policy version (the weights after a training
step and its sync) reaches every generation device when that training step ends, and loading it
costs ``swap_s`` on that device (an assumption, the same estimate as an engine swap).

A generation device serves its share of every batch in turn (the samples are dealt round-robin, as
the trainer's controllers hold their own prompts). When it may start batch ``b`` is ``dispatch``:

- ``step`` (gcore's trainer with ``--trainer.dispatch step``, docs/asynchronous.md): batch ``b``'s requests go out
  when training step ``b - K`` starts, i.e. once batch ``b - K`` is complete on every device and training step
  ``b - K - 1`` has ended (batches ``1..K`` when step 0 starts). A device that finished its share
  early waits for the slowest one. Without partial rollouts a weight update is a request of its own
  on the device, queued behind its share; a request sent while the device loads weights goes to it
  behind the load and starts when the load ends (the trainer's pool sends it at once; before it did,
  the request waited for the controller's next call to the pool, a whole training step at K = 1).
- ``device`` (gcore's trainer by default, ``--trainer.dispatch device``; AReaL/slime-like): a device starts batch
  ``b`` as soon as it is free and policy version ``b - K`` exists, without waiting for the other devices (the
  trainer sends batch ``b``'s requests when training step ``b - K - 1`` has synced, behind those in flight).

Weights: without partial rollouts an update waits behind the share in flight (the trainer queues it
behind the request): a device loads the newest version when it arrives or, if it is generating
then, when its share ends. With partial rollouts (``partial``, the trainer's
``--trainer.partial_rollouts``) an update cuts the share in flight: at the first decode-step
boundary at or after the training step's end the device stops, loads the new weights (``swap_s``),
reads every unfinished response's prompt and tokens so far again (``prefill_token_s``) and
continues them with the new version; a finished response is not touched. There is no token budget:
responses are cut exactly when new weights arrive, and a response ends in the batch it was started
for, so the trained batch size is fixed. Every token records the version that generated it; a
sample's staleness is its first token's (the oldest), so every sample is trained on at most ``K``
versions after the one that wrote its first token (``StepResult.staleness``; per token:
``token_staleness``; samples whose tokens span several versions: ``cut``).

Re-sampling (``resample_fraction``) stays local to a generation device, as in the trainer: a device
draws its second round of batch ``b`` once its own first-round samples have verdicts. The judge
serves older batches first. The training partition is sized once, from the first batch: its share
of the devices is training's share of the work (device-seconds of training, generation and judging,
as the synchronous loop would spend them), rounded up (``train_devices`` overrides it, e.g. to model
a measured run). The placement policy reads each batch's telemetry when the batch is done; its
decision applies from batch ``b + K + 1``, the first that cannot have started yet.

Accounting: a step's time is the time between two training steps' ends; busy and idle are counted
per device in that window (busy intervals clipped to it), so busy + idle = devices x step time.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gcore.errors import ConfigError
from gcore.inflight import prompts_to_draw
from gcore.placement import DynamicPlacement, Telemetry
from gcore.simulator.model import (
    DeviceCosts,
    StepResult,
    Workload,
    binomial_step,
    generation_costs,
    judge_costs,
    judge_each,
    keep_seed,
    record,
    resample_share,
    response_lengths,
    retire,
    rollout_static,
    serve,
)

Intervals = list[tuple[float, float]]
DISPATCH = ("step", "device")


@dataclass
class Response:
    """A response being generated: ``done`` of its ``length`` tokens so far, the first with ``version``;
    ``segments``: (version, tokens) for each run of tokens between two weight loads."""

    length: int
    version: int = -1
    done: int = 0
    segments: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Device:
    """A rollout device: its role, when it is free, the weights its engine holds, and its time line."""

    role: str = ""
    free: float = 0.0
    version: int = 0
    busy: dict[str, Intervals] = field(default_factory=lambda: {"generate": [], "judge": []})
    swap: Intervals = field(default_factory=list)


def draw_batches(work: Workload, devices: int, steps: int, seed: int,
                 oversample_after: int | None = None) -> list[tuple[list[list[int]], int]]:
    """Every step's rounds of response lengths, drawn in the order ``model.simulate`` draws them, and how many of
    its samples are trained on (the batch, or fewer where ``binomial`` rounds fell short).

    ``oversample_after`` (the trainer's ``--trainer.oversample``, with K = ``oversample_after - 1``): batch ``b``'s
    first round starts with ``prompts_to_draw`` samples at the keep rate of batch ``b - oversample_after``, the
    newest whose verdicts exist when it goes out (none for the first ones); its second round is only the shortfall
    at batch ``b``'s own rate. With ``resample_draw: binomial`` that keep rate is the one batch
    ``b - oversample_after`` saw (kept over drawn groups, as the trainer measures it), and the rounds are
    ``keep_rounds``'s."""
    rng = random.Random(seed)
    if work.resample_draw == "binomial":
        return _draw_binomial(work, devices, steps, rng, keep_seed(seed), oversample_after)
    batches = []
    for step in range(steps):
        count = work.samples_per_device * devices
        share = resample_share(work, step)
        known = step - oversample_after if oversample_after is not None else -1
        if known >= 0 and resample_share(work, known) < 1.0:
            first = prompts_to_draw(count, 1.0 - resample_share(work, known))
            again = max(0, count - math.floor(first * (1.0 - share)))
        else:
            first, again = count, round(share * count)
        rounds = [response_lengths(work, step, first, rng)]
        if again:
            rounds.append(response_lengths(work, step, again, rng))
        batches.append((rounds, count))
    return batches


def _draw_binomial(work: Workload, devices: int, steps: int, rng: random.Random, keep_rng: random.Random,
                   oversample_after: int | None) -> list[tuple[list[list[int]], int]]:
    """``draw_batches`` with ``resample_draw: binomial``."""
    batches: list[tuple[list[list[int]], int]] = []
    seen: list[float] = []  # each batch's keep rate, as the trainer measures it
    count = work.samples_per_device * devices
    for step in range(steps):
        known = step - oversample_after if oversample_after is not None else -1
        first = prompts_to_draw(max(1, count // work.group_size), seen[known]) if known >= 0 else None
        rounds, trained, rate = binomial_step(work, step, count, first, rng, keep_rng)
        seen.append(rate)
        batches.append((rounds, trained))
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


def serve_cut(
    steps: list[int], prefill: list[int], costs: DeviceCosts, deadline: float = math.inf,
    intervals: Intervals | None = None,
) -> tuple[list[float | None], list[int], float]:
    """``model.serve`` of requests that all arrive at 0, stopped at the first decode-step boundary at or
    after ``deadline`` (a weight update came: the engine stops between two tokens).

    Returns each request's finish time (``None``: not finished when it stopped), the decode steps each
    did, and when the device stopped (it is busy from 0 to then). With no deadline the times are
    ``serve``'s, computed by the same expressions.
    """
    device = _Device(intervals, [None] * len(steps), [0] * len(steps))
    cap = costs.max_batch or len(steps) or 1
    serve_batches = _serve_static if costs.batching == "static" else _serve_continuous
    serve_batches(steps, prefill, costs, deadline, cap, device)
    return device.finish, device.progress, device.now


@dataclass
class _Device:
    """One device serving requests that all arrived at 0: when each finished (``None``: not finished), the decode
    steps each did, and the device's clock, whose busy stretches go to ``intervals``."""

    intervals: Intervals | None
    finish: list[float | None]
    progress: list[int]
    now: float = 0.0

    def busy(self, seconds: float) -> None:
        """The device works for ``seconds`` from now."""
        begin = self.now
        self.now += seconds
        record(self.intervals, begin, self.now)


def _run_until(now: float, deadline: float, limit: int, cost: Callable[[int], float]) -> tuple[int, float, bool]:
    """``limit`` decode steps from ``now`` and their seconds, or, when they would run past ``deadline``, the
    fewest steps that reach it (the step in flight at the deadline ends) and True: the run is cut."""
    took = cost(limit)
    if not now + took > deadline:
        return limit, took, False
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if cost(mid) >= deadline - now:
            hi = mid
        else:
            lo = mid + 1
    return lo, cost(lo), True


def _serve_static(steps: list[int], prefill: list[int], costs: DeviceCosts, deadline: float, cap: int,
                  device: _Device) -> None:
    """``serve_cut`` with static batching: ``cap`` requests at a time, each batch until its longest ends."""
    n = len(steps)
    for start in range(0, n, cap):
        if device.now >= deadline:
            break
        chunk = list(range(start, min(n, start + cap)))
        length, rows, read = max(steps[i] for i in chunk), len(chunk), sum(prefill[i] for i in chunk)

        def chunk_cost(a: int, rows: int = rows, read: int = read) -> float:
            return costs.decode_s(a, rows, read, read)

        length, took, cut = _run_until(device.now, deadline, length, chunk_cost)
        device.busy(took)
        for i in chunk:
            device.progress[i] = min(steps[i], length)
            if steps[i] <= length:
                device.finish[i] = device.now
        if cut:
            break


def _serve_continuous(steps: list[int], prefill: list[int], costs: DeviceCosts, deadline: float, cap: int,
                      device: _Device) -> None:
    """``serve_cut`` with continuous batching: a request joins as soon as one of the ``cap`` rows is free."""
    n = len(steps)
    running: list[tuple[int, int]] = []  # (decode step count at which it ends, request)
    joined_at = [0] * n
    done_steps, waiting, context = 0, 0, 0
    while (waiting < n or running) and device.now < deadline:
        joined = 0
        while waiting < n and len(running) < cap:
            heapq.heappush(running, (done_steps + steps[waiting], waiting))
            joined_at[waiting] = done_steps
            joined += prefill[waiting]
            waiting += 1
        device.busy(costs.prefill_token_s * joined)
        context += joined
        rows = len(running)
        advance = running[0][0] - done_steps

        def batch_cost(a: int, rows: int = rows, context: int = context) -> float:
            return costs.decode_s(a, rows, context)

        advance, took, cut = _run_until(device.now, deadline, advance, batch_cost)
        device.busy(took)
        done_steps += advance
        context += rows * advance - retire(running, done_steps, device.now, device.finish, prefill, steps)
        if cut:
            break
    for i in range(waiting):
        device.progress[i] = steps[i] if device.finish[i] is not None else done_steps - joined_at[i]


@dataclass
class Batch:
    """What one batch's shares and verdicts leave behind."""

    index: int
    generate_devices: int
    judge_devices: int
    gate: float  # when the batch's requests go out (``dispatch``): no share of this batch starts before
    longest: int = 0
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    generate_busy: list[float] = field(default_factory=list)
    judge_busy: list[float] = field(default_factory=list)
    staleness: Counter[int] = field(default_factory=Counter)
    token_staleness: Counter[int] = field(default_factory=Counter)
    cut: int = 0  # samples whose tokens span more than one version
    consumed: list[int] = field(default_factory=list)  # lengths of the samples trained on
    verdicts: list[float] = field(default_factory=list)


class AsyncRun:
    """The devices, responses in flight and training steps of one asynchronous run (see the module)."""

    def __init__(self, work: Workload, devices: int, max_staleness: int, partial: bool = False,
                 dispatch: str = "step") -> None:
        self.work, self.k, self.partial, self.dispatch = work, max_staleness, partial, dispatch
        self.costs = generation_costs(work)
        self.devices = [Device() for _ in range(devices)]
        self.trained: list[float] = []  # when each training step ends: version v + 1 exists from trained[v] on
        self.train_start: list[float] = []  # when each training step starts (its batch is complete)

    def newest(self, at: float) -> int:
        """The newest policy version that exists at time ``at``."""
        return bisect.bisect_right(self.trained, at)

    def gate(self, index: int) -> float:
        """When batch ``index`` may start (see ``dispatch`` in the module)."""
        if self.k == 0:  # the synchronous loop on roles of their own: after the step before and its sync
            return self.trained[index - 1] if index else 0.0
        if self.dispatch == "device":
            return self.trained[index - self.k - 1] if index - self.k - 1 >= 0 else 0.0
        return self.train_start[max(0, index - self.k)] if index else 0.0

    def begin(self, index: int, g: int, j: int) -> Batch:
        """Gives the devices their roles for batch ``index`` (a device that changes role swaps engines)."""
        for i, device in enumerate(self.devices):
            role = "generate" if i < g else "judge"
            if device.role and device.role != role:
                record(device.swap, device.free, device.free + self.work.swap_s)
                device.free += self.work.swap_s
            device.role = role
        return Batch(index, g, j, self.gate(index), generate_busy=[0.0] * g, judge_busy=[0.0] * j)

    def load(self, device: Device, start: float) -> float:
        """Loads the newest weights there are at ``start``, if the device's are older: from when they came
        (or when the device's last share ended, if later: an update waits behind the share in flight);
        returns when the device can generate."""
        newest = self.newest(start)
        if newest <= device.version:
            return start
        at = max(self.trained[newest - 1], device.free)
        record(device.swap, at, at + self.work.swap_s)
        device.version = newest
        # a request sent while the device loads goes to it behind the load (the trainer's pool sends it at once)
        return max(start, at + self.work.swap_s)

    def share(self, batch: Batch, d: int, items: list[Response], earliest: float) -> list[tuple[Response, float]]:
        """Device ``d`` serves ``items`` for ``batch`` from ``earliest`` on; the finished ones and when."""
        device, work = self.devices[d], self.work
        start = t = self.load(device, max(device.free, earliest, batch.gate))
        done: list[tuple[Response, float]] = []
        pending = items
        while pending:
            arrival = self.trained[device.version] if self.partial and device.version < len(self.trained) else math.inf
            if arrival <= t:  # partial rollouts: new weights cut the share in flight; load them, continue
                record(device.swap, t, t + work.swap_s)
                device.version = self.newest(t)
                t += work.swap_s
                continue
            timeline: Intervals = []
            finish, progress, took = serve_cut(
                [r.length - r.done for r in pending], [work.prompt_tokens + r.done for r in pending], self.costs,
                arrival - t, timeline,
            )
            for a, e in timeline:
                record(device.busy["generate"], t + a, t + e)
            batch.generate_busy[d] += took
            left = []
            for r, end, tokens in zip(pending, finish, progress, strict=True):
                if tokens:
                    if r.version < 0:
                        r.version = device.version
                    r.segments.append((device.version, tokens))
                    r.done += tokens
                    batch.longest = max(batch.longest, tokens)
                if end is None:
                    left.append(r)
                else:
                    done.append((r, t + end))
            t += took
            pending = left
        device.free = t
        batch.starts.append(start)
        batch.ends.append(t)
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
            for version, tokens in r.segments:
                batch.token_staleness[batch.index - version] += tokens
            batch.cut += len({version for version, _ in r.segments}) > 1
            batch.consumed.append(r.length)
        batch.verdicts += verdicts
        return verdicts

    def rollout(self, batch: Batch, rounds: list[list[int]]) -> float:
        """Generates and judges ``batch``; when it is complete (every device has reported its share)."""
        g = batch.generate_devices
        first = [
            (d, r, t) for d in range(g)
            for r, t in self.share(batch, d, [Response(n) for n in rounds[0][d::g]], 0.0)
        ]
        verdicts = self.judge(batch, first)
        own = [0.0] * g
        for lengths in rounds[1:]:  # each device re-samples once its own samples of the round before have verdicts
            for (d, _, _), t in zip(first, verdicts, strict=True):
                own[d] = max(own[d], t)
            first = [
                (d, r, t) for d in range(g)
                for r, t in self.share(batch, d, [Response(n) for n in lengths[d::g]], own[d])
            ]
            verdicts = self.judge(batch, first)
        return max([*batch.verdicts, *batch.ends])


def simulate_async(
    policy: DynamicPlacement,
    devices: int,
    steps: int,
    work: Workload,
    seed: int = 0,
    max_staleness: int = 1,
    partial: bool = False,
    dispatch: str = "step",
    train_devices: int | None = None,
    oversample: bool = False,
) -> list[StepResult]:
    """Runs ``steps`` training steps on ``devices`` devices with staleness ``max_staleness`` and,
    with ``partial``, partial rollouts: a weight update cuts the responses in flight (see the module).
    ``dispatch``: when a batch's requests go out (``step``: ``--trainer.dispatch step``; ``device``: the trainer's
    default, each device on its own); ``train_devices``: the training partition's size (default: sized from the
    first batch); ``oversample``: the trainer's ``--trainer.oversample`` (``draw_batches``; the samples kept beyond
    the batch are judged but not trained).
    ``max_staleness`` 0 is the synchronous loop with roles of their own (the trainer with engine workers: a
    batch starts when the step before has trained and synced); ``gcore simulate``'s K = 0 rows are
    ``model.simulate``'s, whose devices take every role in turn."""
    if not isinstance(policy, DynamicPlacement):
        raise ConfigError("max_staleness >= 1 needs the dynamic placement (roles that do not swap)")
    if max_staleness < 0 or (max_staleness == 0 and partial):
        raise ConfigError(f"max_staleness {max_staleness}: expected >= 0 (partial rollouts: >= 1)")
    if dispatch not in DISPATCH:
        raise ConfigError(f"dispatch {dispatch!r}: valid choices: {', '.join(DISPATCH)}")
    if devices < 4 or steps < 1:
        raise ConfigError("the asynchronous model needs devices >= 4 (train, generate, judge) and steps >= 1")
    # the newest keep rate when batch b goes out: step b - K - 1's (``device``, and K = 0), step b - K's (``step``)
    after = max_staleness + 1 if dispatch == "device" or max_staleness == 0 else max_staleness
    batches = draw_batches(work, devices, steps, seed, after if oversample else None)
    if train_devices is None:
        train_devices = size_training(work, devices, batches[0][0])
    elif not 1 <= train_devices <= devices - 2:
        raise ConfigError(f"train_devices {train_devices}: expected 1..{devices - 2} (generate, judge: one each)")
    policy.setup(devices - train_devices, "simulated")
    run = AsyncRun(work, policy.total, max_staleness, partial, dispatch)
    split = {0: (policy.generate_devices, policy.judge_devices)}
    logs = []
    for b, (rounds, trained) in enumerate(batches):
        batch = run.begin(b, *split[max(s for s in split if s <= b)])
        complete = run.rollout(batch, rounds)
        batch.consumed = batch.consumed[:trained]  # the groups dropped and ``oversample``'s surplus: not trained
        tokens = sum(length + work.prompt_tokens for length in batch.consumed)
        train_s = work.train_step_s + work.train_token_s * tokens / train_devices
        run.train_start.append(max(complete, run.trained[-1] if run.trained else 0.0))
        run.trained.append(run.train_start[-1] + train_s)
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
            dict(batch.staleness), batch.longest, train_devices, dict(batch.token_staleness), batch.cut,
        ))
    return results
