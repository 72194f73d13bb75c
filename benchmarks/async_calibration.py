"""The simulator's asynchronous model (``gcore simulate --max-staleness K [--partial-rollouts]``) against real runs.

The real runs are ``benchmarks/async_overlap.py`` runs of the trainer with two CPU engine workers, saved with
``--save`` (their figures and every step's metrics.csv row); this script keeps the per-step figures the
model needs and checks the model on them:

    python benchmarks/async_overlap.py --ks 0 1 1p 2 2p --rounds 1 --steps 20 --seed 7 --save /tmp/seed7.json \
        -- --placement.workers 2 --sampling.max_new_tokens 64          # and seeds 8, 9
    python benchmarks/async_calibration.py --measured /tmp/seed7.json /tmp/seed8.json /tmp/seed9.json \
        --write examples/simulate/async_tiny_measurements.json
    python benchmarks/async_calibration.py --check examples/simulate/async_tiny_measurements.json

``--check`` (about a second) fits the costs (``gcore.simulator.calibration.fit_async``: a worker's decode
step, the controller's time per step, the weight load, the length distribution) on the runs whose label is
in ``--fit`` (default K = 0 and K = 1, every seed), runs the simulator for every run (its K, partial
rollouts or not, seed and steps; ``predict_async``) and prints the measured and predicted generation idle
share and samples/s, the error of each, and the held-out runs' mean and worst error; then the same with
one seed held out at a time (fit on the other seeds' runs of every label).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gcore.simulator.calibration import ASYNC_METRICS, MeasuredRun, fit_async, predict_async


def number(text: str | None) -> float:
    try:
        return round(float(text), 6) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def extract(paths: list[str]) -> dict:
    """The per-step figures of every run in ``async_overlap.py --save`` files."""
    runs = []
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        command = saved["command"]
        seed = int(command.split("--trainer.seed ")[1].split()[0])
        tokens = int(command.split("--sampling.max_new_tokens ")[1].split()[0])
        for run in saved["runs"]:
            runs.append({
                "label": run["k"], "seed": seed, "workers": run["workers"], "max_new_tokens": tokens,
                "warmup": saved["warmup"], "load": run["load"],
                "metrics": {name: [number(row.get(name)) for row in run["rows"]] for name in ASYNC_METRICS},
            })
    return {"command": "python benchmarks/async_overlap.py --ks 0 1 1p 2 2p --rounds 1 --steps 20 --seed S "
                       "-- --placement.workers 2 --sampling.max_new_tokens 64", "runs": runs}


def load(path: str) -> list[MeasuredRun]:
    with open(path) as f:
        raw = json.load(f)
    return [MeasuredRun(**{k: v for k, v in run.items()}) for run in raw["runs"]]


def report(title: str, fit: list[MeasuredRun], runs: list[MeasuredRun]) -> None:
    costs = fit_async(fit)
    print(f"\n{title}")
    print("  fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in costs.items()))
    print(f"  {'run':<10} {'':>4} {'idle meas':>9} {'pred':>6} {'abs err':>8} "
          f"{'samples/s meas':>14} {'pred':>7} {'rel err':>8} {'cut meas':>8} {'pred':>6}")
    held: list[tuple[float, float]] = []
    for r in runs:
        p = predict_async(costs, r)
        out = r not in fit
        idle_err, rate_err = p["idle"] - r.idle(), p["samples_per_s"] / r.samples_per_s() - 1
        if out:
            held.append((abs(idle_err), abs(rate_err)))
        cut = sum(r.col("async/partial_samples"))
        print(f"  K={r.label:<3} s{r.seed:<3} {'held' if out else 'fit':>4} {r.idle():9.1%} {p['idle']:6.1%} "
              f"{idle_err * 100:+7.1f}pp {r.samples_per_s():14.1f} {p['samples_per_s']:7.1f} {rate_err:+8.1%} "
              f"{cut:8.0f} {p['cut']:6.0f}")
    if held:
        print(f"  held out ({len(held)} runs): idle share error mean "
              f"{statistics.mean(h[0] for h in held) * 100:.1f}pp, "
              f"worst {max(h[0] for h in held) * 100:.1f}pp; samples/s error mean "
              f"{statistics.mean(h[1] for h in held):.1%}, worst {max(h[1] for h in held):.1%}")


def mechanism(runs: list[MeasuredRun]) -> None:
    """Each run predicted with the costs fitted on that run alone: checks the pipeline (when generation starts,
    where updates cut it, what idles) apart from the costs, which on 2 shared cores change with what overlaps."""
    print("\nmechanism check: each run with its own fitted costs (decode step, controller time, lengths)")
    print(f"  {'run':<10} {'decode ms':>9} {'ctrl s':>7} {'idle meas':>9} {'pred':>6} {'abs err':>8} "
          f"{'samples/s meas':>14} {'pred':>7} {'rel err':>8} {'cut meas':>8} {'pred':>6}")
    errors = []
    for r in runs:
        costs = fit_async([r])
        p = predict_async(costs, r)
        idle_err, rate_err = p["idle"] - r.idle(), p["samples_per_s"] / r.samples_per_s() - 1
        errors.append((abs(idle_err), abs(rate_err)))
        print(f"  K={r.label:<3} s{r.seed:<3} {costs['decode_step_s'] * 1000:9.2f} {costs['train_step_s']:7.3f} "
              f"{r.idle():9.1%} {p['idle']:6.1%} {idle_err * 100:+7.1f}pp {r.samples_per_s():14.1f} "
              f"{p['samples_per_s']:7.1f} {rate_err:+8.1%} {sum(r.col('async/partial_samples')):8.0f} {p['cut']:6.0f}")
    print(f"  all {len(errors)} runs: idle share error mean {statistics.mean(e[0] for e in errors) * 100:.1f}pp, "
          f"worst {max(e[0] for e in errors) * 100:.1f}pp; samples/s error mean "
          f"{statistics.mean(e[1] for e in errors):.1%}, worst {max(e[1] for e in errors):.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", nargs="+", help="async_overlap.py --save files to extract")
    parser.add_argument("--write", help="where --measured writes the extracted runs")
    parser.add_argument("--check", help="extracted runs: fit, predict, print the errors")
    parser.add_argument("--fit", nargs="+", default=["0", "1"], help="labels fitted on (the others are held out)")
    args = parser.parse_args()
    if args.measured:
        data = extract(args.measured)
        with open(args.write, "w") as f:
            json.dump(data, f, indent=None, separators=(",", ":"))
            f.write("\n")
        print(f"{len(data['runs'])} runs -> {args.write}")
    if args.check:
        runs = load(args.check)
        fit = [r for r in runs if r.label in args.fit]
        report(f"fit on K in {{{', '.join(args.fit)}}} (every seed), the others held out:", fit, runs)
        mechanism(runs)
        for seed in sorted({r.seed for r in runs}):
            others = [r for r in runs if r.seed != seed]
            if others:
                report(f"seed {seed} held out (fit on the other seeds' runs of every K):", others,
                       [r for r in runs if r.seed == seed])


if __name__ == "__main__":
    main()
