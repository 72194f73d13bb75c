"""A discrete-event simulator of training steps on G devices under a ``PlacementPolicy``.

Each step: generate (continuous batching per device, long-tailed response lengths that drift over
training), judge with a GenRM, swap engines, train on all devices. ``static`` time-shares every
device (generate, swap, judge, swap, train, swap); ``dynamic`` runs generation and the judge on two
partitions at once, streaming each finished sample to the first free judge device, and re-sizes the
partitions from the step's per-role busy times through the same ``DynamicPlacement.update`` the
trainer calls.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field

from gcore.errors import ConfigError
from gcore.placement.base import PlacementPolicy, Telemetry
from gcore.placement.dynamic import DynamicPlacement
from gcore.placement.static import StaticPlacement


@dataclass
class Workload:
    """Costs and length distributions (seconds are per device).

    Args:
        samples_per_device: completions per step per device (the global batch scales with G).
        prompt_tokens: prompt length.
        median_tokens: median response length at step 0 (log-normal).
        sigma: log-normal shape; larger is a longer tail.
        max_tokens: generation budget (lengths are cut here).
        length_drift: relative growth of the median response length per step.
        decode_step_s: one decode step of a device's running batch (the latency floor of the tail).
        generate_token_s: throughput cost per generated token on a device.
        judge_token_s: judge cost per token read (prompt + response) on a device.
        judge_generate_token_s: judge cost per token it writes (throughput, on a device).
        judge_output_tokens: tokens the judge writes per verdict.
        judge_decode_step_s: one decode step of the judge.
        swap_s: putting one set of engines/weights to sleep and waking another.
        train_token_s: training cost per token (forward + backward) on a device.
    """

    samples_per_device: int = 32
    prompt_tokens: int = 256
    median_tokens: float = 600.0
    sigma: float = 0.9
    max_tokens: int = 8192
    length_drift: float = 0.02
    decode_step_s: float = 0.02
    generate_token_s: float = 0.0006
    judge_token_s: float = 0.0001
    judge_generate_token_s: float = 0.0006
    judge_output_tokens: int = 64
    judge_decode_step_s: float = 0.02
    swap_s: float = 8.0
    train_token_s: float = 0.00025


@dataclass
class StepResult:
    step: int
    step_s: float
    generate_devices: int
    judge_devices: int
    idle: dict[str, float] = field(default_factory=dict)  # role -> idle device-seconds
    busy: dict[str, float] = field(default_factory=dict)  # role -> busy device-seconds


def response_lengths(work: Workload, step: int, count: int, rng: random.Random) -> list[int]:
    median = work.median_tokens * (1 + work.length_drift) ** step
    return [max(1, min(work.max_tokens, int(rng.lognormvariate(math.log(median), work.sigma)))) for _ in range(count)]


def generate(work: Workload, lengths: list[int], devices: int) -> tuple[list[float], float]:
    """Finish time of every sample and the busy device-seconds, samples dealt round-robin."""
    finish = [0.0] * len(lengths)
    busy = 0.0
    for d in range(devices):
        mine = sorted(range(d, len(lengths), devices), key=lambda i: lengths[i])
        generated, done_tokens, prev = 0, 0, 0
        for rank, i in enumerate(mine):
            # tokens generated on this device by the time sample i ends: all shorter ones in full,
            # plus len_i for each still running
            done_tokens += lengths[i]
            generated = done_tokens + lengths[i] * (len(mine) - rank - 1)
            finish[i] = work.decode_step_s * lengths[i] + work.generate_token_s * generated
            prev = finish[i]
        busy += prev
    return finish, busy


def judge(work: Workload, arrivals: list[float], lengths: list[int], devices: int) -> tuple[float, float]:
    """When the last verdict is in, and the busy device-seconds; each device serves a FIFO queue."""
    free = [0.0] * devices
    heapq.heapify(free)
    end, busy = 0.0, 0.0
    for i in sorted(range(len(lengths)), key=lambda k: arrivals[k]):
        cost = work.judge_token_s * (work.prompt_tokens + lengths[i])
        cost += work.judge_generate_token_s * work.judge_output_tokens
        start = max(arrivals[i], heapq.heappop(free))
        heapq.heappush(free, start + cost)
        busy += cost
        end = max(end, start + cost + work.judge_decode_step_s * work.judge_output_tokens)
    return end, busy


def simulate(policy: PlacementPolicy, devices: int, steps: int, work: Workload, seed: int = 0) -> list[StepResult]:
    """Runs ``steps`` steps on ``devices`` devices; the same seed gives every policy the same lengths."""
    if devices < 1 or steps < 1:
        raise ConfigError("simulate needs devices >= 1 and steps >= 1")
    policy.setup(devices, "simulated")
    dynamic = isinstance(policy, DynamicPlacement)
    rng = random.Random(seed)
    results = []
    for step in range(steps):
        lengths = response_lengths(work, step, work.samples_per_device * devices, rng)
        tokens = sum(lengths) + work.prompt_tokens * len(lengths)
        train_s = work.train_token_s * tokens / devices
        if dynamic:
            g, j = policy.generate_devices, policy.judge_devices
            finish, gen_busy = generate(work, lengths, g)
            judge_end, judge_busy = judge(work, finish, lengths, j)
            rollout = max(max(finish), judge_end)
            idle = {"generate": g * rollout - gen_busy, "judge": j * rollout - judge_busy, "swap": 2 * devices * work.swap_s}
            step_s = rollout + 2 * work.swap_s + train_s
            policy.update(Telemetry(step, [{"generate": gen_busy / g, "reward": judge_busy / j, "rollout": rollout}]))
        else:
            g = j = devices
            finish, gen_busy = generate(work, lengths, devices)
            gen_end = max(finish)
            judge_end, judge_busy = judge(work, [0.0] * len(lengths), lengths, devices)
            idle = {"generate": devices * gen_end - gen_busy, "judge": devices * judge_end - judge_busy, "swap": 3 * devices * work.swap_s}
            step_s = gen_end + judge_end + 3 * work.swap_s + train_s
            policy.update(Telemetry(step, [{"generate": gen_end, "reward": judge_end}]))
        results.append(
            StepResult(step, step_s, g, j, idle, {"generate": gen_busy, "judge": judge_busy, "train": train_s * devices})
        )
    return results


def summarize(results: list[StepResult], devices: int) -> dict[str, float]:
    """Mean step time, idle fraction per role and overall, and device-hours for all steps."""
    total = sum(r.step_s for r in results)
    summary = {"step_s": total / len(results), "device_hours": devices * total / 3600}
    for role in ("generate", "judge", "swap"):
        summary[f"idle_{role}"] = sum(r.idle[role] for r in results) / (devices * total)
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
    return Workload(**work), raw.get("dynamic", {}) or {}


def compare(devices: int, steps: int, work: Workload, dynamic_options: dict, seed: int = 0) -> dict[str, list[StepResult]]:
    return {
        "static": simulate(StaticPlacement(offload=True), devices, steps, work, seed),
        "dynamic": simulate(DynamicPlacement(**dynamic_options), devices, steps, work, seed),
    }


def main(argv: list[str]) -> int:
    """``gcore simulate``: static vs dynamic on a workload YAML, printed and plotted."""
    import argparse

    parser = argparse.ArgumentParser(prog="gcore simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML with a 'workload:' section (and optional 'dynamic:' options)")
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 512], help="cluster sizes (8..1024)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="simulate.png", help="PNG path; {devices} is replaced per size")
    args = parser.parse_args(argv)
    work, dynamic_options = load_workload(args.config)
    for devices in args.devices:
        if not 2 <= devices <= 4096:
            raise ConfigError(f"--devices {devices}: expected 2..4096")
        runs = compare(devices, args.steps, work, dynamic_options, args.seed)
        base = summarize(runs["static"], devices)
        print(f"{devices} devices, {args.steps} steps")
        print(f"  {'policy':<8} {'step_s':>8} {'idle':>6} {'idle_gen':>8} {'idle_judge':>10} {'idle_swap':>9} {'dev_h':>9} {'idle_dev_h':>10}")
        for name, results in runs.items():
            s = summarize(results, devices)
            print(
                f"  {name:<8} {s['step_s']:8.1f} {s['idle']:6.3f} {s['idle_generate']:8.3f} {s['idle_judge']:10.3f} "
                f"{s['idle_swap']:9.3f} {s['device_hours']:9.1f} {s['idle_device_hours']:10.1f}"
            )
        dyn = summarize(runs["dynamic"], devices)
        print(
            f"  dynamic/static: step time x{dyn['step_s'] / base['step_s']:.3f}, "
            f"idle device-hours x{dyn['idle_device_hours'] / base['idle_device_hours']:.3f}, "
            f"final split {runs['dynamic'][-1].generate_devices} generate / {runs['dynamic'][-1].judge_devices} judge"
        )
        path = args.plot.replace("{devices}", str(devices)) if "{devices}" in args.plot else (
            args.plot if len(args.devices) == 1 else args.plot.replace(".png", f"_{devices}.png")
        )
        try:
            plot(runs, devices, path)
            print(f"  plot: {path}")
        except ImportError:
            print("  (no plot: pip install matplotlib)")
    return 0
