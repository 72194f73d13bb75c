"""The embedded multi-turn task: does the tiny model use what the environment reveals?

Runs what ``gcore fit --env reveal`` runs (every option at its default: the default task with its digit
hidden, 30 steps, 16 new tokens a turn, the digit revealed ``--env.repeat`` = 32 times) and, as a control, the
same with ``--env.show false`` (the observation shows ``?`` instead of the digit). A policy that ignores the
observation can at best repeat one digit: 0.1 on average. Prints the mean reward per 10 steps for each seed
and setting, and with ``--out DIR`` keeps each run's per-step ``reward/mean`` as ``DIR/<setting>-<seed>.csv``.

    python benchmarks/reveal_learning.py --seeds 0 1 2 3 --out benchmarks/results/raw/reveal-defaults
"""

import argparse
import csv
import tempfile
from pathlib import Path

from gcore import Trainer, TrainerConfig
from gcore.envs.reveal import RevealEnvironment


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=32)
    parser.add_argument("--out", help="a folder for each run's per-step rewards")
    args = parser.parse_args()
    for seed in args.seeds:
        for name, show in (("revealed", True), ("hidden", False)):
            result = Trainer(
                trainer=TrainerConfig(max_steps=args.steps, seed=seed, default_root_dir=tempfile.mkdtemp(),
                                      enable_progress_bar=False, save_final=False),
                env=RevealEnvironment(repeat=args.repeat, show=show),
            ).fit()
            rewards = [m["reward/mean"] for m in result.history]
            blocks = [round(sum(rewards[i : i + 10]) / len(rewards[i : i + 10]), 3) for i in range(0, len(rewards), 10)]
            seconds = sum(m["time/step"] for m in result.history)
            print(f"seed {seed} {name:8s} mean reward per 10 steps {blocks}  ({seconds:.0f} s of steps)", flush=True)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                with open(Path(args.out) / f"{name}-{seed}.csv", "w", newline="") as f:
                    writer = csv.writer(f)
                    writer.writerow(["step", "reward/mean"])
                    writer.writerows(enumerate(rewards))


if __name__ == "__main__":
    main()
