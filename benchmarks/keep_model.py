"""Dynamic sampling's kept groups in real runs against the simulator's two keep models (``resample_draw``).

    python benchmarks/keep_model.py --seeds 0 1 2 3 --steps 40
    python benchmarks/keep_model.py --seeds 0 1 -- --data.task compare

Runs ``gcore fit --algorithm dapo --trainer.oversample true`` (this checkout first on ``PYTHONPATH``) once per
seed and reads each step's ``filter/*`` metrics. With ``--trainer.oversample`` a step's first round draws
``prompts_to_draw(target, keep rate the step before saw)`` prompts; a second round follows when fewer than
``target`` of them are kept. For every step after the first, with ``p`` the keep rate of the steps around it
(``--window`` steps either side, the step itself left out, so the step's own outcome does not enter its
prediction), the script adds up

- the ``binomial`` model's chance of a second round, ``P(Binomial(first, p) < target)`` (each group kept on
  its own with probability ``p``), and
- the ``share`` model's verdict, 1 when ``floor(first * p) < target`` (exactly that share kept, every time),

and prints them beside the second rounds the runs had (``filter/rounds_max`` > 1). Nothing here is timed.
Everything after ``--`` is passed on to ``gcore fit``.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gcore.inflight import prompts_to_draw  # noqa: E402


def below(n: int, p: float, k: int) -> float:
    """``P(Binomial(n, p) < k)``."""
    return sum(math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(min(k, n + 1)))


def predictions(rows: list[dict[str, str]], window: int) -> tuple[int, float, int, int]:
    """Second rounds observed, expected by ``binomial``, by ``share``, and the steps counted, of one run."""
    sampled = [float(r["filter/groups_sampled"]) for r in rows]
    kept = [s - float(r["filter/groups_dropped"]) for s, r in zip(sampled, rows, strict=True)]
    target = int(float(rows[0]["filter/groups_trained"]))
    observed, binomial, share = 0, 0.0, 0
    for i in range(1, len(rows)):
        around = [j for j in range(max(1, i - window), min(len(rows), i + window + 1)) if j != i]
        p = sum(kept[j] for j in around) / sum(sampled[j] for j in around)
        first = prompts_to_draw(target, kept[i - 1] / sampled[i - 1])
        observed += float(rows[i]["filter/rounds_max"]) > 1
        binomial += below(first, p, target)
        share += math.floor(first * p) < target
    return observed, binomial, share, len(rows) - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=3, help="steps either side whose keep rate predicts a step's")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    totals = [0, 0.0, 0, 0]
    print(f"{'seed':>4} {'steps':>5} {'observed':>8} {'binomial':>8} {'share':>5}")
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as root:
            command = [sys.executable, "-m", "gcore", "fit", "--algorithm", "dapo", "--trainer.oversample", "true",
                       "--trainer.max_steps", str(args.steps), "--trainer.seed", str(seed),
                       "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", root, *extra]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            (path,) = glob.glob(os.path.join(root, "gcore", "version_*", "metrics.csv"))
            with open(path) as f:
                figures = predictions(list(csv.DictReader(f)), args.window)
        totals = [t + f for t, f in zip(totals, figures, strict=True)]
        observed, binomial, share, steps = figures
        print(f"{seed:>4} {steps:>5} {observed:>8} {binomial:>8.1f} {share:>5}")
    observed, binomial, share, steps = totals
    print(f"{'all':>4} {steps:>5} {observed:>8} {binomial:>8.1f} {share:>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
