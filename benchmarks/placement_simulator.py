"""Static vs dynamic placement in `gcore simulate`: main table, best fixed split, sensitivity.

    python benchmarks/placement_simulator.py --config examples/simulate/genrm_cpu_calibrated.yaml \
        --devices 64 512 --steps 30 --sensitivity-devices 64 --plot sim.png

Prints, per cluster size and policy: mean step time, idle fraction per role, device-hours and idle
device-hours for all steps, and the ratios against static (with --max-staleness K, also dynamic
placement trained asynchronously, and with --partial-rollouts with partial rollouts cut at each weight
sync, --dispatch as in `gcore simulate`); then the
best fixed judge partition (found by trying every split on the first steps) against the split the
policy converged to; then a sensitivity table (one workload field changed at a time) of
dynamic/static ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gcore.placement.dynamic import DynamicPlacement
from gcore.simulator.asynchronous import DISPATCH
from gcore.simulator.cli import run_all
from gcore.simulator.model import compare, load_workload, plot, simulate, summarize

SENSITIVITY = [
    ("judge cost x0.25", lambda w: replace(w, judge_output_tokens=max(1, w.judge_output_tokens // 4))),
    ("judge cost x4", lambda w: replace(w, judge_output_tokens=w.judge_output_tokens * 4)),
    ("judge cost x8", lambda w: replace(w, judge_output_tokens=w.judge_output_tokens * 8)),
    ("context cost x0.1 (weights-bound decode, as on GPUs)", lambda w: replace(
        w, context_token_s=w.context_token_s / 10, judge_context_token_s=w.judge_context_token_s / 10)),
    ("context x0.1 and judge cost x4", lambda w: replace(
        w, context_token_s=w.context_token_s / 10, judge_context_token_s=w.judge_context_token_s / 10,
        judge_output_tokens=w.judge_output_tokens * 4)),
    ("sigma 0.3 (short tail)", lambda w: replace(w, sigma=0.3)),
    ("sigma 1.3 (long tail)", lambda w: replace(w, sigma=1.3)),
    ("swap 0 s", lambda w: replace(w, swap_s=0.0)),
    ("swap 10 s", lambda w: replace(w, swap_s=10.0)),
    ("no drift", lambda w: replace(w, length_drift=0.0)),
    ("no re-sampling", lambda w: replace(w, resample_fraction=0.0, resample_drift=0.0)),
    ("no re-sampling, swap 0 s", lambda w: replace(w, resample_fraction=0.0, resample_drift=0.0, swap_s=0.0)),
]


def most_saved(static: dict, dynamic: dict) -> float:
    """About the share of static's idle device-hours that overlapping the judge with generation can save
    (all the judge's busy time moved into generation's idle, plus the swaps dynamic skips); not a strict
    bound: a smaller generation partition also leaves fewer devices waiting in the tail."""
    judge = static["busy_judge"] * static["device_hours"]
    swaps = static["idle_swap"] * static["device_hours"] - dynamic["idle_swap"] * dynamic["device_hours"]
    return (judge + swaps) / static["idle_device_hours"]


def table(runs: dict, devices: int) -> None:
    base = summarize(runs["static"], devices)
    bound = most_saved(base, summarize(runs["dynamic"], devices))
    print(f"static: judge busy {base['busy_judge']:.3f} of device time; the most idle dynamic can save is "
          f"about {bound:.0%} of static's\n")
    print("| policy | step s | idle | idle gen / judge / train / swap | device-h | idle device-h "
          "| step vs static | idle vs static |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for name, results in runs.items():
        s = summarize(results, devices)
        print(
            f"| {name} | {s['step_s']:.1f} | {s['idle']:.3f} | {s['idle_generate']:.3f} / {s['idle_judge']:.3f} / "
            f"{s['idle_train']:.3f} / {s['idle_swap']:.3f} | {s['device_hours']:.1f} | {s['idle_device_hours']:.2f} | "
            f"x{s['step_s'] / base['step_s']:.3f} | x{s['idle_device_hours'] / base['idle_device_hours']:.3f} |"
        )


def best_fixed_split(devices: int, steps: int, work, options: dict) -> tuple[int, float]:
    """The judge partition with the least idle device-hours when held fixed (coarse then fine search)."""

    def idle(j: int) -> float:
        fixed = {**options, "judge_fraction": j / devices, "min_fraction": 1 / devices, "hysteresis": 1e9}
        return summarize(simulate(DynamicPlacement(**fixed), devices, steps, work), devices)["idle_device_hours"]

    stride = max(1, devices // 16)
    coarse = min(range(stride, devices - 1, stride), key=idle)
    fine = range(max(1, coarse - stride + 1), min(devices - 1, coarse + stride))
    best = min(fine, key=idle)
    return best, idle(best)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sensitivity-devices", type=int, default=64)
    parser.add_argument("--split-steps", type=int, default=5, help="steps per trial when searching the best split")
    parser.add_argument("--plot", default="sim.png")
    parser.add_argument("--max-staleness", type=int, default=0, help="also dynamic trained with staleness K (>= 1)")
    parser.add_argument("--partial-rollouts", action="store_true", help="and with partial rollouts (cut at each sync)")
    parser.add_argument("--dispatch", choices=DISPATCH, default="step", help="as gcore simulate's --dispatch")
    args = parser.parse_args()
    work, options = load_workload(args.config)
    for devices in args.devices:
        runs = run_all(devices, args.steps, work, options, max_staleness=args.max_staleness,
                       partial=args.partial_rollouts, dispatch=args.dispatch)
        print(f"\n{devices} devices, {args.steps} steps ({args.config})\n")
        table(runs, devices)
        path = args.plot.replace(".png", f"_{devices}.png")
        plot(runs, devices, path)
        print(f"\nplot: {path}")
    devices = args.sensitivity_devices
    steps = args.split_steps
    first = compare(devices, steps, work, options, release_tail=False)
    early = {name: summarize(r, devices) for name, r in first.items()}
    converged = first["dynamic"]
    best, best_idle = best_fixed_split(devices, steps, work, options)
    print(f"\nbest fixed judge partition at {devices} devices over the first {steps} steps: {best} "
          f"(idle device-h {best_idle:.3f}); the policy: {[r.judge_devices for r in converged]} "
          f"(idle device-h {early['dynamic']['idle_device_hours']:.3f}, "
          f"static {early['static']['idle_device_hours']:.3f})")
    print(f"\nsensitivity at {devices} devices, {args.steps} steps (ratios against static)\n")
    print("| change | most idle an overlap can save | dynamic: step | dynamic: idle device-h | "
          "dynamic+release: step | dynamic+release: idle device-h |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, change in [("as configured", lambda w: w), *SENSITIVITY]:
        runs = compare(devices, args.steps, change(work), options)
        s = {name: summarize(r, devices) for name, r in runs.items()}
        ratio = {
            name: (s[name]["step_s"] / s["static"]["step_s"],
                   s[name]["idle_device_hours"] / s["static"]["idle_device_hours"])
            for name in ("dynamic", "dynamic+release")
        }
        print(f"| {label} | {most_saved(s['static'], s['dynamic']):.0%} | x{ratio['dynamic'][0]:.3f} | "
              f"x{ratio['dynamic'][1]:.3f} | "
              f"x{ratio['dynamic+release'][0]:.3f} | x{ratio['dynamic+release'][1]:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
