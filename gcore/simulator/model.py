"""A discrete-event simulator of training steps on G devices under a ``PlacementPolicy``.

Each step: generate (continuous batching per device, long-tailed response lengths that drift over
training), judge with a GenRM, swap engines, train on all devices. ``static`` time-shares every
device (generate, swap, judge, swap, train, swap); ``dynamic`` runs generation and the judge on two
partitions at once, streaming each finished sample to the first free judge device, and re-sizes the
partitions from the step's per-role busy times through the same ``DynamicPlacement.update`` the
trainer calls. This is the synchronous loop (staleness K = 0); ``asynchronous.py`` builds K >= 1
and partial rollouts on the same device model.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field
from typing import cast

from gcore.errors import ConfigError
from gcore.inflight import next_round
from gcore.placement import DynamicPlacement, PlacementPolicy, StaticPlacement, Telemetry

BATCHING = ("continuous", "static")
RESAMPLE_DRAWS = ("share", "binomial")


@dataclass
class Workload:
    """Costs and length distributions (seconds are per device).

    A device serves its sequences in decode steps; one step of a batch of ``b`` running sequences
    costs ``decode_step_s + b * generate_token_s`` (a latency floor plus a throughput cost), and a
    sequence joining the batch first costs its prompt's prefill. The judge is served the same way
    with its own costs.

    Args:
        samples_per_device: completions per step per device (the global batch scales with G).
        prompt_tokens: prompt length.
        median_tokens: median response length at step 0 (log-normal).
        sigma: log-normal shape; larger is a longer tail (0: every response has the median length).
        max_tokens: generation budget (lengths are cut here).
        length_drift: relative growth of the median response length per step.
        resample_fraction: share of the samples generated (and judged) again in a second round at
            step 0 (dynamic sampling: groups whose rewards were all equal are dropped and re-drawn).
        resample_drift: change of that share per step (clamped to [0, 1]).
        resample_draw: how the dropped samples are drawn. ``share``: exactly that share of the first round, drawn
            again once in a second round that is all kept. ``binomial``: as dynamic sampling does it, each group of
            ``group_size`` samples is kept with probability 1 - share; rounds follow the trainer's ``filter``
            (the next round is the shortfall over the keep rate seen so far, at most ``max_rounds`` rounds).
        group_size: samples per prompt (``--sampling.n``); with ``binomial``, the unit kept or dropped.
        max_rounds: with ``binomial``, the most generation rounds a step takes (``--algorithm.max_rounds``); a
            step still short after them trains on the groups it has.
        decode_step_s: one decode step of a device's running batch (the latency floor of the tail).
        generate_token_s: throughput cost per generated token on a device.
        prefill_token_s: prefill cost per prompt token of the policy (and per context token of a
            paused partial rollout read again).
        context_token_s: attention cost per decode step and token held in a running sequence's context.
        max_batch: most sequences a generation device runs at once (0: no limit); more wait in a queue.
        batching: ``continuous`` (a finished sequence leaves the batch and a waiting one joins, as in
            vLLM/SGLang) or ``static`` (fixed batches whose rows all step until the longest ends, as
            the ``hf`` engine does).
        judge_token_s: judge cost per token read (prompt + response + template) on a device.
        judge_prompt_tokens: tokens of the judge's template besides the prompt and the response.
        judge_generate_token_s: judge cost per token it writes (throughput, on a device).
        judge_output_tokens: tokens the judge writes per verdict.
        judge_decode_step_s: one decode step of the judge.
        judge_max_batch: most verdicts a judge device computes at once (0: no limit).
        judge_context_token_s: the judge's attention cost per decode step and context token.
        swap_s: putting one set of engines/weights to sleep and waking another.
        train_token_s: training cost per token (forward + backward) on a device.
        train_step_s: fixed training cost per step (optimizer step, collectives).
    """

    samples_per_device: int = 32
    prompt_tokens: int = 256
    median_tokens: float = 600.0
    sigma: float = 0.9
    max_tokens: int = 8192
    length_drift: float = 0.02
    resample_fraction: float = 0.0
    resample_drift: float = 0.0
    resample_draw: str = "share"
    group_size: int = 8
    max_rounds: int = 3
    decode_step_s: float = 0.02
    generate_token_s: float = 0.0006
    prefill_token_s: float = 0.0
    context_token_s: float = 0.0
    max_batch: int = 0
    batching: str = "continuous"
    judge_token_s: float = 0.0001
    judge_prompt_tokens: int = 0
    judge_generate_token_s: float = 0.0006
    judge_output_tokens: int = 64
    judge_decode_step_s: float = 0.02
    judge_max_batch: int = 0
    judge_context_token_s: float = 0.0
    swap_s: float = 8.0
    train_token_s: float = 0.00025
    train_step_s: float = 0.0

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise ConfigError(f"workload batching {self.batching!r}: valid choices: {', '.join(BATCHING)}")
        if self.resample_draw not in RESAMPLE_DRAWS:
            raise ConfigError(f"workload resample_draw {self.resample_draw!r}: valid choices: "
                              f"{', '.join(RESAMPLE_DRAWS)}")
        for name in ("samples_per_device", "median_tokens", "max_tokens", "judge_output_tokens", "group_size",
                     "max_rounds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"workload {name} must be positive, got {getattr(self, name)}")
        drifts = ("length_drift", "resample_drift")
        negative = [k for k, v in asdict(self).items() if isinstance(v, (int, float)) and v < 0 and k not in drifts]
        if negative:
            raise ConfigError(f"workload {', '.join(negative)} must not be negative")


@dataclass
class StepResult:
    step: int
    step_s: float
    generate_devices: int
    judge_devices: int
    idle: dict[str, float] = field(default_factory=dict)  # role -> idle device-seconds
    busy: dict[str, float] = field(default_factory=dict)  # role -> busy device-seconds
    stages: dict[str, float] = field(default_factory=dict)  # stage -> seconds of this step's critical path
    staleness: dict[int, int] = field(default_factory=dict)  # versions behind -> samples trained on in this step
    longest_segment: int = 0  # most tokens one response generated between two weight loads, for this step
    train_devices: int = 0  # devices that train (0: all of them, in turn with the engines)
    token_staleness: dict[int, int] = field(default_factory=dict)  # versions behind -> tokens trained on (async)
    cut: int = 0  # samples trained on whose tokens span more than one version (partial rollouts)


def resample_share(work: Workload, step: int) -> float:
    """The share of step ``step``'s samples that dynamic sampling drops (and draws again)."""
    return min(1.0, max(0.0, work.resample_fraction + work.resample_drift * step))


def keep_rounds(work: Workload, step: int, first: int, target: int, rng: random.Random) -> tuple[list[int], int]:
    """``binomial``: the groups each of step ``step``'s rounds draws, and how many groups are kept in all, the first
    round drawing ``first`` groups for a batch of ``target``: each group is kept with probability 1 - share, and
    each further round is the trainer's (``controller.next_round``), until ``target`` groups are kept or
    ``max_rounds`` rounds are drawn."""
    keep = 1.0 - resample_share(work, step)
    sizes, drawn, kept = [first], first, sum(rng.random() < keep for _ in range(first))
    while kept < target and len(sizes) < work.max_rounds:
        extra = next_round(target, kept, drawn)
        sizes.append(extra)
        drawn += extra
        kept += sum(rng.random() < keep for _ in range(extra))
    return sizes, kept


def binomial_step(work: Workload, step: int, count: int, first: int | None, rng: random.Random,
                  keep_rng: random.Random) -> tuple[list[list[int]], int, float]:
    """``binomial``: step ``step``'s rounds of response lengths for a batch of ``count`` samples, the first round
    drawing ``first`` groups (default: the batch's), how many samples are trained on (the batch, or fewer where the
    rounds fell short) and the keep rate the step saw (kept over drawn groups, as the trainer measures it)."""
    target = max(1, count // work.group_size)
    sizes, kept = keep_rounds(work, step, target if first is None else first, target, keep_rng)
    rounds = [response_lengths(work, step, size * work.group_size, rng) for size in sizes]
    return rounds, min(count, kept * work.group_size), kept / sum(sizes)


def keep_seed(seed: int) -> random.Random:
    """The keep draws' own stream, apart from the lengths' (``binomial``)."""
    return random.Random(f"keep-{seed}")


def response_lengths(work: Workload, step: int, count: int, rng: random.Random) -> list[int]:
    median = work.median_tokens * (1 + work.length_drift) ** step
    if work.sigma == 0:
        return [max(1, min(work.max_tokens, round(median)))] * count
    return [max(1, min(work.max_tokens, int(rng.lognormvariate(math.log(median), work.sigma)))) for _ in range(count)]


@dataclass
class DeviceCosts:
    """How one device serves sequences: see ``Workload``."""

    step_s: float
    token_s: float
    prefill_token_s: float
    max_batch: int = 0
    batching: str = "continuous"
    context_token_s: float = 0.0

    def decode_s(self, steps: int, rows: int, context: int, read: int = 0) -> float:
        """Seconds for ``rows`` sequences holding ``context`` tokens to take ``steps`` decode steps together (each
        row's context grows by one token a step), after a prefill of ``read`` tokens."""
        took = self.prefill_token_s * read + steps * (self.step_s + self.token_s * rows)
        return took + self.context_token_s * (steps * context + rows * steps * (steps + 1) / 2)


def record(intervals: list[tuple[float, float]] | None, start: float, end: float) -> None:
    """Appends the busy interval ``[start, end]``, merged with the last one when they touch."""
    if intervals is None or end <= start:
        return
    if intervals and intervals[-1][1] == start:
        intervals[-1] = (intervals[-1][0], end)
    else:
        intervals.append((start, end))


def serve(
    arrivals: list[float],
    steps: list[int],
    prefill: list[int],
    costs: DeviceCosts,
    intervals: list[tuple[float, float]] | None = None,
) -> tuple[list[float], float]:
    """One device serving requests in arrival order: each request's finish time and the busy seconds.

    Request ``i`` arrives at ``arrivals[i]``, reads ``prefill[i]`` tokens when it joins the running
    batch and then needs ``steps[i]`` decode steps. A step of ``b`` running requests whose contexts
    hold ``c`` tokens in all costs ``step_s + b * token_s + c * context_token_s``. Between two events
    (a request joins or ends) the batch does not change, so the loop jumps from event to event.
    ``intervals``, when given, receives the busy intervals (the asynchronous model's accounting).
    """
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
    finish = [0.0] * len(arrivals)
    cap = costs.max_batch or len(arrivals) or 1
    now = busy = 0.0
    if costs.batching == "static":
        for start in range(0, len(order), cap):
            chunk = order[start : start + cap]
            length, rows, read = max(steps[i] for i in chunk), len(chunk), sum(prefill[i] for i in chunk)
            took = costs.decode_s(length, rows, read, read)  # every row steps until the longest ends
            begin = max(now, max(arrivals[i] for i in chunk))
            now = begin + took
            record(intervals, begin, now)
            busy += took
            for i in chunk:
                finish[i] = now
        return finish, busy
    running: list[tuple[int, int]] = []  # (decode step count at which it ends, request)
    done_steps, waiting, context = 0, 0, 0
    while waiting < len(order) or running:
        joined = 0
        while waiting < len(order) and len(running) < cap and arrivals[order[waiting]] <= now:
            i = order[waiting]
            heapq.heappush(running, (done_steps + steps[i], i))
            joined += prefill[i]
            waiting += 1
        if not running:
            now = arrivals[order[waiting]]
            continue
        begin = now
        now += costs.prefill_token_s * joined
        record(intervals, begin, now)
        busy += costs.prefill_token_s * joined
        context += joined
        rows = len(running)
        step = costs.step_s + costs.token_s * rows + costs.context_token_s * (context + rows)
        advance = running[0][0] - done_steps
        if waiting < len(order) and rows < cap:  # the next arrival joins at a step boundary
            advance = min(advance, max(1, math.ceil((arrivals[order[waiting]] - now) / step) if step > 0 else 1))
        took = costs.decode_s(advance, rows, context)
        begin = now
        now += took
        record(intervals, begin, now)
        busy += took
        done_steps += advance
        context += rows * advance - retire(running, done_steps, now, finish, prefill, steps)
    return finish, busy


def retire(running: list[tuple[int, int]], done_steps: int, now: float, finish: list, prefill: list[int],
           steps: list[int]) -> int:
    """Takes the requests that have ended by decode step ``done_steps`` out of ``running`` (a heap of (the step
    count at which it ends, request)), with ``now`` as their finish time; returns the context tokens they free."""
    freed = 0
    while running and running[0][0] <= done_steps:
        i = heapq.heappop(running)[1]
        finish[i] = now
        freed += prefill[i] + steps[i]
    return freed


def generation_costs(work: Workload) -> DeviceCosts:
    return DeviceCosts(
        work.decode_step_s, work.generate_token_s, work.prefill_token_s, work.max_batch, work.batching,
        work.context_token_s,
    )


def judge_costs(work: Workload) -> DeviceCosts:
    return DeviceCosts(
        work.judge_decode_step_s, work.judge_generate_token_s, work.judge_token_s, work.judge_max_batch, work.batching,
        work.judge_context_token_s,
    )


def generate(work: Workload, lengths: list[int], devices: int) -> tuple[list[float], list[float]]:
    """Finish time of every sample and each device's busy seconds; samples are dealt round-robin."""
    finish = [0.0] * len(lengths)
    busy = []
    costs = generation_costs(work)
    for d in range(devices):
        mine = list(range(d, len(lengths), devices))
        ends, device_busy = serve([0.0] * len(mine), [lengths[i] for i in mine], [work.prompt_tokens] * len(mine),
                                  costs)
        for i, end in zip(mine, ends, strict=False):
            finish[i] = end
        busy.append(device_busy)
    return finish, busy


def judge(
    work: Workload, arrivals: list[float], lengths: list[int], devices: int, online: list[float] | None = None
) -> tuple[float, list[float]]:
    """When the last verdict is in, and each judge device's busy seconds.

    Samples stream to the judge devices in the order they arrive; each goes to the device expected
    to be free first (by the judge's throughput cost of what it already holds; on a tie, the one
    given fewer verdicts), a device taking work from ``online[d]`` on (default 0). Each device batches
    the verdicts it holds like any engine.
    """
    verdicts, busy, _ = judge_each(work, arrivals, lengths, devices, online)
    return max([0.0, *verdicts]), busy


def judge_each(
    work: Workload,
    arrivals: list[float],
    lengths: list[int],
    devices: int,
    online: list[float] | None = None,
    intervals: list[list[tuple[float, float]]] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """``judge``, per sample: each verdict's time, each device's busy seconds, and when each device
    is free again; ``intervals[d]``, when given, receives device ``d``'s busy intervals."""
    online = online or [0.0] * devices
    order = sorted(range(len(lengths)), key=arrivals.__getitem__)
    free = [(online[d], 0, d) for d in range(devices)]  # (expected free, verdicts given, device)
    heapq.heapify(free)
    assigned: list[list[int]] = [[] for _ in range(devices)]
    for i in order:
        ready, count, d = heapq.heappop(free)
        read = work.judge_prompt_tokens + work.prompt_tokens + lengths[i]
        cost = work.judge_token_s * read + work.judge_generate_token_s * work.judge_output_tokens
        heapq.heappush(free, (max(ready, arrivals[i]) + cost, count + 1, d))
        assigned[d].append(i)
    costs = judge_costs(work)
    verdicts, busy, free_at = [0.0] * len(lengths), [], list(online)
    for d, mine in enumerate(assigned):
        ends, device_busy = serve(
            [max(arrivals[i], online[d]) for i in mine],
            [work.judge_output_tokens] * len(mine),
            [work.judge_prompt_tokens + work.prompt_tokens + lengths[i] for i in mine],
            costs,
            None if intervals is None else intervals[d],
        )
        for i, end in zip(mine, ends, strict=True):
            verdicts[i] = end
        free_at[d] = max([free_at[d], *ends])
        busy.append(device_busy)
    return verdicts, busy, free_at


@dataclass
class Rollout:
    """One round of generation and judging under a placement."""

    seconds: float
    generate_s: float
    judge_s: float  # after generation ends (static: the judge phase; dynamic: the judge's tail)
    generate_busy: list[float]
    judge_busy: list[float]
    idle: dict[str, float]
    extra_swaps: int = 0  # device swaps beyond the policy's per-step ones (released tail devices)


def rollout_static(work: Workload, lengths: list[int], devices: int) -> Rollout:
    """Every device generates its share, then judges the samples it generated."""
    finish, gen_busy = generate(work, lengths, devices)
    gen_end = max(finish)
    judge_end = 0.0
    judge_busy: list[float] = []
    for d in range(devices):  # generate dealt the samples round-robin
        mine = list(range(d, len(lengths), devices))
        end, busy = judge(work, [0.0] * len(mine), [lengths[i] for i in mine], 1)
        judge_end, judge_busy = max(judge_end, end), judge_busy + busy
    idle = {"generate": devices * gen_end - sum(gen_busy), "judge": devices * judge_end - sum(judge_busy)}
    return Rollout(gen_end + judge_end, gen_end, judge_end, gen_busy, judge_busy, idle)


def rollout_dynamic(work: Workload, lengths: list[int], g: int, j: int, release_tail: bool) -> Rollout:
    """``g`` devices generate while ``j`` judge each sample as it finishes (see ``simulate``)."""
    finish, gen_busy = generate(work, lengths, g)
    gen_end = max(finish)
    ends = [max(finish[d::g], default=0.0) for d in range(g)]  # generate deals the samples round-robin
    released = [d for d in range(g) if release_tail and ends[d] + 2 * work.swap_s < gen_end]
    online = [0.0] * j + [ends[d] + work.swap_s for d in released]
    judge_end, judge_busy = judge(work, finish, lengths, j + len(released), online)
    seconds = max(gen_end, judge_end)
    held = {d: ends[d] for d in released}  # a released device leaves generation when its share is done
    idle = {
        "generate": sum(held.get(d, seconds) - gen_busy[d] for d in range(g)),
        "judge": sum(seconds - start - b for start, b in zip(online, judge_busy, strict=False)),
    }
    return Rollout(seconds, gen_end, seconds - gen_end, gen_busy, judge_busy, idle, len(released))


def simulate(
    policy: PlacementPolicy, devices: int, steps: int, work: Workload, seed: int = 0, release_tail: bool = False
) -> list[StepResult]:
    """Runs ``steps`` steps on ``devices`` devices; the same seed gives every policy the same lengths.

    ``static``: every device generates its share, then swaps to the judge and judges its own samples,
    then swaps to training, trains, and swaps back (three swaps). ``dynamic``: ``g`` devices generate
    while ``j`` devices judge each sample as it finishes (no swap between the two), then all swap to
    training and back (two swaps). ``release_tail`` (dynamic only; not in the trainer): a generation
    device that has finished its share while others still decode their long tail swaps to the judge
    and takes verdicts, when that swap ends before generation does (the simulator knows when).
    Samples that need re-sampling (``resample_fraction``) are generated and judged in a second round;
    under static that round costs two more swaps (back to generation, then to the judge).

    Idle device-seconds per role: the time a role's devices hold the role with nothing to run
    (waiting for other devices, or for samples to judge); swaps are counted apart.
    """
    if devices < 1 or steps < 1:
        raise ConfigError("simulate needs devices >= 1 and steps >= 1")
    policy.setup(devices, "simulated")
    dynamic = isinstance(policy, DynamicPlacement)
    if release_tail and not dynamic:
        raise ConfigError("release_tail needs the dynamic placement")
    rng, keep_rng = random.Random(seed), keep_seed(seed)
    results = []
    for step in range(steps):
        count = work.samples_per_device * devices
        if work.resample_draw == "binomial":
            rounds, trained, _ = binomial_step(work, step, count, None, rng, keep_rng)
            lengths = [n for r in rounds for n in r][:trained]
        else:
            lengths = response_lengths(work, step, count, rng)
            share = resample_share(work, step)
            rounds = [lengths]
            if round(share * count):
                rounds.append(response_lengths(work, step, round(share * count), rng))
        tokens = sum(lengths) + work.prompt_tokens * len(lengths)
        train_s = work.train_step_s + work.train_token_s * tokens / devices
        g, j = ((cast(DynamicPlacement, policy).generate_devices, cast(DynamicPlacement, policy).judge_devices)
                if dynamic else (devices, devices))
        done = [
            rollout_dynamic(work, r, g, j, release_tail) if dynamic else rollout_static(work, r, devices)
            for r in rounds
        ]
        swaps = 2 if dynamic else 3 + 2 * (len(rounds) - 1)
        rollout = sum(r.seconds for r in done)
        gen_busy = [sum(b) for b in zip(*(r.generate_busy for r in done), strict=False)]
        judge_busy = [sum(b) for b in zip(*(r.judge_busy[:j] for r in done), strict=False)]
        if dynamic:
            # each round's longest response decoded alone: more generation devices cannot shorten this
            costs = generation_costs(work)
            longest = sum(serve([0.0], [max(r)], [work.prompt_tokens], costs)[1] for r in rounds)
            read = work.judge_prompt_tokens + work.prompt_tokens + max(lengths)
            verdict = len(rounds) * serve([0.0], [work.judge_output_tokens], [read], judge_costs(work))[1]
            per_device = [{"generate": b, "generate_floor": longest, "rollout": rollout} for b in gen_busy]
            per_device += [{"reward": b, "reward_floor": verdict, "rollout": rollout} for b in judge_busy]
        else:
            per_device = [{"generate": b, "reward": jb} for b, jb in zip(gen_busy, judge_busy, strict=False)]
        policy.update(Telemetry(step, per_device))
        idle = {role: sum(r.idle[role] for r in done) for role in ("generate", "judge")}
        idle["swap"] = (swaps * devices + sum(r.extra_swaps for r in done)) * work.swap_s
        stages = {
            "generate": sum(r.generate_s for r in done),
            "judge": sum(r.judge_s for r in done),
            "rollout": rollout,
            "swap": swaps * work.swap_s,
            "train": train_s,
        }
        step_s = rollout + swaps * work.swap_s + train_s
        busy = {
            "generate": sum(sum(r.generate_busy) for r in done),
            "judge": sum(sum(r.judge_busy) for r in done),
            "train": train_s * devices,
        }
        staleness = {0: sum(len(r) for r in rounds)}  # synchronous: every sample from the current weights
        results.append(StepResult(step, step_s, g, j, idle, busy, stages, staleness, max(map(max, rounds))))
    return results


def summarize(results: list[StepResult], devices: int) -> dict[str, float]:
    """Mean step time, idle fraction per role and overall, and device-hours for all steps."""
    total = sum(r.step_s for r in results)
    summary = {"step_s": total / len(results), "device_hours": devices * total / 3600}
    for role in ("generate", "judge", "train", "swap"):  # training idles only on its own partition (asynchronous)
        summary[f"idle_{role}"] = sum(r.idle.get(role, 0.0) for r in results) / (devices * total)
    summary["busy_judge"] = sum(r.busy["judge"] for r in results) / (devices * total)
    idle = sum(sum(r.idle.values()) for r in results)
    summary["idle"] = idle / (devices * total)
    summary["idle_device_hours"] = idle / 3600
    return summary


def plot(runs: dict[str, list[StepResult]], devices: int, path: str) -> None:
    """A PNG: the judge partition and the idle fraction per step, for each policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, results in runs.items():
        steps = [r.step for r in results]
        if name != "static":
            top.plot(steps, [r.judge_devices for r in results], label=f"{name}: judge devices")
            top.plot(steps, [r.generate_devices for r in results], "--", label=f"{name}: generate devices")
        bottom.plot(steps, [sum(r.idle.values()) / (devices * r.step_s) for r in results], label=name)
    top.set_ylabel("devices")
    top.legend(fontsize=8)
    bottom.set_ylabel("idle fraction")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.suptitle(f"{devices} devices")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_workload(path: str | None) -> tuple[Workload, dict]:
    """The ``workload:`` section of a YAML file as a ``Workload``, plus the ``dynamic:`` options."""
    if path is None:
        return Workload(), {}
    import yaml

    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror}") from err
    known = set(asdict(Workload()))
    work = raw.get("workload", {}) or {}
    unknown = sorted(set(work) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown workload key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    try:
        return Workload(**work), raw.get("dynamic", {}) or {}
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def compare(
    devices: int, steps: int, work: Workload, dynamic_options: dict, seed: int = 0, release_tail: bool = True
) -> dict[str, list[StepResult]]:
    """``static`` and ``dynamic`` (and ``dynamic+release``: dynamic with ``release_tail``) on the same lengths."""
    runs = {
        "static": simulate(StaticPlacement(offload=True), devices, steps, work, seed),
        "dynamic": simulate(DynamicPlacement(**dynamic_options), devices, steps, work, seed),
    }
    if release_tail:
        runs["dynamic+release"] = simulate(DynamicPlacement(**dynamic_options), devices, steps, work, seed, True)
    return runs
