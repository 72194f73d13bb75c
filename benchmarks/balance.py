"""Balanced versus round-robin assignment of prompts to 2 controllers, long-tailed prompt lengths.

Writes a prompt set whose lengths follow a Pareto distribution (most prompts short, a few very
long), then runs `gcore fit --trainer.devices 2` with `--data.balance true` and `false`,
alternating A B A B, and prints per-step medians: step time, imbalance (slowest controller's step
time over the mean), predicted imbalance, and micro-batch padding, with the balanced/round-robin
ratios.

    python benchmarks/balance.py --steps 8 --repeats 2
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

KEYS = ("time/step", "time/imbalance", "balance/predicted_imbalance", "padding_frac", "time/generate", "time/train")


def write_prompts(path: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            digit = str(rng.randrange(10))
            length = min(int(rng.paretovariate(1.2) * 8), 400)
            f.write(json.dumps({"prompt": "x" * length + digit + "=", "answer": digit}) + "\n")


def run(root: str, data: str, balance: bool, steps: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
           "--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false",
           "--trainer.default_root_dir", root, "--data.path", data, "--data.prompts_per_step", "16",
           "--data.balance", str(balance).lower(), "--model.max_position_embeddings", "512",
           "--sampling.n", "4", "--sampling.max_new_tokens", "16"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    versions = sorted(os.listdir(os.path.join(root, "gcore")), key=lambda v: int(v.split("_")[1]))
    with open(os.path.join(root, "gcore", versions[-1], "metrics.csv")) as f:
        rows = list(csv.DictReader(f))[1:]  # drop the warm-up step
    return {k: statistics.median(float(r[k]) for r in rows) for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    data = os.path.join(root, "prompts.jsonl")
    write_prompts(data, 512, seed=0)
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for balance in (True, False):
            results[balance].append(run(os.path.join(root, "runs"), data, balance, args.steps))
    print(f"{'metric (median)':<30}{'balanced':>10}{'round-robin':>13}{'ratio':>8}")
    for key in KEYS:
        b = statistics.median(r[key] for r in results[True])
        rr = statistics.median(r[key] for r in results[False])
        print(f"{key:<30}{b:>10.3f}{rr:>13.3f}{(b / rr if rr else float('nan')):>8.2f}")


if __name__ == "__main__":
    main()
