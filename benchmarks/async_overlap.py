"""``--trainer.max_staleness`` 0 vs 1 (or any K, ``--ks``) on one workload, alternated (CPU engine workers).

    python benchmarks/async_overlap.py --rounds 2 --steps 20 -- --placement dynamic --placement.workers 1
    python benchmarks/async_overlap.py --ks 0 1 2 --rounds 1 -- --placement.workers 2
    python benchmarks/async_overlap.py --judge --rounds 1 --steps 8 -- --placement dynamic --placement.workers 2
    python benchmarks/async_overlap.py --ks 0 1 1p 2 2p --rounds 2 -- --placement.workers 2 --sampling.max_new_tokens 64

Runs ``gcore fit`` (this checkout first on ``PYTHONPATH``) with the same seed and options, each K of
``--ks`` in turn (default K=0 then K=1; ``1p``: K=1 with ``--trainer.partial_rollouts true``; ``1o``: K=1 with
``--trainer.oversample true``, for ``--algorithm dapo``), ``--rounds``
times, and prints for each run the machine load
(``/proc/loadavg``) before it, the samples per second over the steps after ``--warmup`` (samples
generated / the sum of ``time/step``), the median step, train and rollout-wait times, the staleness
each K >= 1 run logged (and the samples it regenerated because they were older than K), the generation
workers' idle share over the whole run (1 - their busy seconds over workers x the steps' seconds;
``--placement.workers`` read from the options), the samples a weight update cut (partial rollouts), and then the
reward per step of each K (the mean over the rounds) and over the last quarter of the steps, to see
whether learning per step holds. ``--judge``: the reward is a generative judge, the embedded tiny
model (another seed) with the ``probability`` verdict (``--reward generative``), judged in the
pipeline with K >= 1 (docs/asynchronous.md). Everything after ``--`` is passed on to ``gcore fit``.
Record the output in BENCHMARKS.md with the command, the date and the load. ``--save FILE``: every run's
figures and metrics.csv rows as json, for ``benchmarks/async_calibration.py`` (the simulator's asynchronous
model against these runs).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def tiny_judge() -> str:
    """The embedded tiny model (seed 1, the policy's shape) written as a checkpoint the judge loads."""
    sys.path.insert(0, ROOT)
    from gcore.model import ModelConfig, char_tokenizer, materialize

    return materialize(ModelConfig(), char_tokenizer(), 1, tempfile.mkdtemp(prefix="gcore-judge-"))


def run(label: str, args: argparse.Namespace, extra: list[str]) -> dict:
    k, partial, oversample = int(label.rstrip("po")), "p" in label, "o" in label
    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, "-m", "gcore.cli", "fit", "--trainer.max_steps", str(args.steps),
               "--trainer.seed", str(args.seed), "--trainer.enable_progress_bar", "false",
               "--trainer.save_final", "false", "--trainer.default_root_dir", root, "--trainer.max_staleness", str(k),
               "--trainer.partial_rollouts", str(partial).lower(), *extra]
        if oversample:  # dynamic sampling's extra prompts up front (needs --algorithm dapo in ``extra``)
            cmd += ["--trainer.oversample", "true"]
        before = load()
        started = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode:
            sys.exit(f"K={k} failed:\n{done.stderr[-3000:]}")
        path = next(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f == "metrics.csv")
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    timed = rows[args.warmup:]
    col = lambda name, rs=timed: [float(r[name]) for r in rs if r.get(name)]  # noqa: E731
    workers = int(extra[extra.index("--placement.workers") + 1]) if "--placement.workers" in extra else 1
    # over every step: with K >= 1 a step's rollout ran during the step before, so part of the first timed step's
    # busy time lies in the warm-up (a bias as large as one step when steps are few)
    busy = (workers * (sum(col("time/rollout", rows)) - sum(col("time/reward", rows)))
            - sum(col("time/idle_generate", rows)))
    return {
        "k": label, "load": before, "wall": wall,
        "idle": 1.0 - busy / (workers * sum(col("time/step", rows))),
        "partial": sum(col("async/partial_samples", rows)),
        "samples_per_s": sum(col("samples/total")) / sum(col("time/step")),
        "step": statistics.median(col("time/step")), "train": statistics.median(col("time/train")),
        "wait": statistics.median(col("async/rollout_wait_s")) if k else float("nan"),
        "staleness": max(col("async/staleness_max", rows), default=0.0),
        "regenerated": sum(col("async/regenerated_stale", rows)),
        "rewards": col("reward/mean", rows),
        "workers": workers, "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timings")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--ks", nargs="+", default=["0", "1"],
                        help="the max_staleness values to run; a trailing p: with partial rollouts (1p); o: with "
                             "--trainer.oversample (1o, 1po; pass --algorithm dapo after --)")
    parser.add_argument("--judge", action="store_true", help="a generative judge (the embedded tiny model) scores")
    parser.add_argument("--save", help="write every run (its figures and its metrics.csv rows) to this json "
                        "(benchmarks/async_calibration.py fits the simulator to it)")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.judge:
        extra += ["--reward", "generative", "--reward.path", tiny_judge(), "--reward.verdict", "probability"]
    print(f"gcore fit {' '.join(extra)} --trainer.max_steps {args.steps} --trainer.seed {args.seed}; "
          f"{os.cpu_count()} cores", flush=True)
    results = []
    for round_ in range(args.rounds):
        for k in args.ks:
            r = run(k, args, extra)
            results.append(r)
            print(f"round {round_} K={k}: load {r['load']}; {r['samples_per_s']:.2f} samples/s; median step "
                  f"{r['step']:.2f}s, train {r['train']:.2f}s, rollout wait {r['wait']:.2f}s; staleness max "
                  f"{r['staleness']:.0f}, regenerated {r['regenerated']:.0f}; generation idle {r['idle']:.0%}, "
                  f"samples cut by an update {r['partial']:.0f}; run {r['wall']:.0f}s", flush=True)
    for k in args.ks:
        mine = [r for r in results if r["k"] == k]
        rates = [r["samples_per_s"] for r in mine]
        curve = [statistics.mean(values) for values in zip(*(r["rewards"] for r in mine), strict=True)]
        tail = curve[-max(1, len(curve) // 4):]
        idle = statistics.mean(r["idle"] for r in mine)
        print(f"K={k}: samples/s {' '.join(f'{x:.2f}' for x in rates)} (mean {statistics.mean(rates):.2f}); "
              f"generation idle {idle:.0%}; "
              f"reward of the last {len(tail)} steps {statistics.mean(tail):.3f}; reward per step "
              + " ".join(f"{x:.3f}" for x in curve))
    print(f"load after: {load()}")
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"command": f"gcore fit {' '.join(extra)} --trainer.max_steps {args.steps} "
                       f"--trainer.seed {args.seed}", "warmup": args.warmup, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
