"""Summarise ``benchmarks/lora_vs_full.sh OUT``: per run, the median step and train-stage time, the
summed stage times, weight-sync bytes per step, peak RSS (``/usr/bin/time -v``) and the held-out
accuracy logged before the first and after the last step.

    python benchmarks/lora_vs_full_summary.py OUT
"""

from __future__ import annotations

import csv
import glob
import os
import statistics
import sys


def _float(row: dict[str, str], key: str) -> float | None:
    value = row.get(key, "")
    return float(value) if value not in ("", None) else None


def summarise(run_dir: str, time_file: str) -> dict[str, object]:
    """One run's figures: its metrics.csv under ``run_dir`` and its ``/usr/bin/time -v`` output."""
    (path,) = glob.glob(os.path.join(run_dir, "*", "version_0", "metrics.csv"))
    with open(path) as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if _float(r, "time/step") is not None]
    evals = [(r["step"], _float(r, "eval/accuracy_greedy"), _float(r, "eval/accuracy_sampled"))
             for r in rows if _float(r, "eval/accuracy_greedy") is not None]
    rss_kb = next(int(line.split(":")[1]) for line in open(time_file) if "Maximum resident set size" in line)

    def col(key: str) -> list[float]:
        return [v for r in steps if (v := _float(r, key)) is not None]

    return {
        "steps": len(steps),
        "step_s_median": statistics.median(col("time/step")),
        "train_s_median": statistics.median(col("time/train")),
        "generate_s_median": statistics.median(col("time/generate")),
        "sum_s": {k: round(sum(col(f"time/{k}")), 1) for k in ("generate", "prepare", "train", "sync")},
        "sync_gb_per_step": statistics.median(col("sync/gb")),
        "reward": [round(v, 3) for v in col("reward/mean")],
        "peak_rss_gb": rss_kb / 2**20,
        "eval (step, greedy, sampled)": evals,
    }


def main() -> None:
    out = sys.argv[1]
    for time_file in sorted(glob.glob(os.path.join(out, "*.time"))):
        name = os.path.basename(time_file)[: -len(".time")]
        print(name, summarise(os.path.join(out, name), time_file))
    with open(os.path.join(out, "load.txt")) as f:
        print(f.read())


if __name__ == "__main__":
    main()
