"""PPO, GRPO and DAPO side by side on the embedded task: the same seed, steps and batch.

    python benchmarks/algorithms.py --steps 30 --seed 42

Prints, per algorithm, the mean reward of the first and last 5 steps, the wall time, and the
ratios to GRPO. Record the output in BENCHMARKS.md with the date, the machine and the command.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time

import torch

from gcore import DAPO, GRPO, PPO, Trainer, TrainerConfig


def run(name: str, algorithm, steps: int, seed: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        result = Trainer(
            trainer=TrainerConfig(max_steps=steps, seed=seed, default_root_dir=root, enable_progress_bar=False,
                                  save_final=False),
            algorithm=algorithm,
        ).fit()
        seconds = time.perf_counter() - start
    rewards = [m["reward/mean"] for m in result.history]
    window = min(5, len(rewards))
    return {
        "name": name,
        "first": sum(rewards[:window]) / window,
        "last": sum(rewards[-window:]) / window,
        "seconds": seconds,
        "generated": sum(m["samples/total"] for m in result.history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.steps} steps, seed {args.seed}")
    rows = [run(name, algo, args.steps, args.seed) for name, algo in
            (("ppo", PPO()), ("grpo", GRPO()), ("dapo", DAPO()))]
    grpo = next(r for r in rows if r["name"] == "grpo")
    print("| algorithm | reward, first 5 steps | reward, last 5 steps | samples generated | wall s | time / grpo |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['name']} | {r['first']:.3f} | {r['last']:.3f} | {r['generated']:.0f} | {r['seconds']:.1f} | "
              f"{r['seconds'] / grpo['seconds']:.2f} |")


if __name__ == "__main__":
    main()
