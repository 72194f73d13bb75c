"""One controller driving 2 processes versus 2 parallel controllers, with heavy per-sample features.

Every prompt carries a synthetic feature of ``--feature-mb`` MB (an image stand-in, float32, made
by the controller that takes the prompt) that must reach the process that generates for it and the
one that trains on its samples. With ``--trainer.controllers 1`` rank 0 takes the whole batch and
sends each rank its prompts and training rows, features included; with parallel controllers each
rank makes the features of its own shard and nothing moves. Runs both, alternating A B A B, and
prints medians: samples/s, step time and its stages, the peak RSS of the busiest process and of
rank 0, and the bytes rank 0 sent per step, with the parallel/single ratios.

    python benchmarks/controllers.py --steps 6 --repeats 2 --feature-mb 1
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile

KEYS = ("samples_per_s", "time/step", "time/generate", "time/reward", "time/prepare", "time/train",
        "memory/peak_rss_gb", "memory/rank0_peak_rss_gb", "controller/sent_gb")


def run(root: str, controllers: int | None, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
           "--trainer.max_steps", str(args.steps), "--trainer.enable_progress_bar", "false",
           "--trainer.save_final", "false", "--trainer.default_root_dir", root,
           "--data.prompts_per_step", str(args.prompts), "--sampling.n", str(args.n),
           "--data.synthetic_feature_mb", str(args.feature_mb)]
    if controllers is not None:
        cmd += ["--trainer.controllers", str(controllers)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    versions = sorted(os.listdir(os.path.join(root, "gcore")), key=lambda v: int(v.split("_")[1]))
    with open(os.path.join(root, "gcore", versions[-1], "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["samples_per_s"] = float(row["samples/total"]) / float(row["time/step"])
        row.setdefault("controller/sent_gb", 0.0)
    steady = rows[1:]  # drop the warm-up step
    out = {k: statistics.median(float(r[k] or 0.0) for r in steady) for k in KEYS}
    for k in ("memory/peak_rss_gb", "memory/rank0_peak_rss_gb"):  # high-water marks: the run's last value
        out[k] = float(rows[-1][k])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--feature-mb", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step over both processes")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    modes = {"single (1 controller)": 1, "parallel (2 controllers)": None}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, controllers in modes.items():
            results[name].append(run(os.path.join(root, name.split()[0]), controllers, args))
    print(f"{args.prompts} prompts x {args.n} samples per step, {args.feature_mb} MB feature per prompt, "
          f"{args.repeats} repeats x {args.steps} steps, medians")
    single, parallel = (list(modes)[0], list(modes)[1])
    print(f"{'metric':<28}{'single':>12}{'parallel':>12}{'parallel/single':>17}")
    for key in KEYS:
        a = statistics.median(r[key] for r in results[single])
        b = statistics.median(r[key] for r in results[parallel])
        ratio = b / a if a else float("nan")
        print(f"{key:<28}{a:>12.3f}{b:>12.3f}{ratio:>17.2f}")


if __name__ == "__main__":
    main()
