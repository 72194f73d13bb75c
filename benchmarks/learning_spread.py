"""The spread of a learning test's statistic over seeds: first-5 and last-5 mean reward of one default run per seed.

The learning tests (tests/trainer/test_learning.py and others) set their thresholds from this spread; run it with
``OMP_NUM_THREADS=1`` and without, as CI runs the suite on one thread per test process:

    OMP_NUM_THREADS=1 python benchmarks/learning_spread.py --algorithm ppo --seeds 0-9

Prints one JSON line per seed (with the critic's value gain for PPO), then the mean and standard deviation of
the gains and the share of seed triples whose mean gain falls under ``--threshold``.
"""

import argparse
import itertools
import json
import statistics
import tempfile

from gcore import DAPO, GRPO, PPO, RLOO, Trainer, TrainerConfig
from gcore.data import DataConfig

ALGORITHMS = {"ppo": PPO, "grpo": GRPO, "rloo": RLOO, "dapo": DAPO}


def seeds(text: str) -> list[int]:
    """``0-9`` or ``0,3,5``."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def first_last(history: list[dict[str, float]], key: str) -> tuple[float, float]:
    values = [m[key] for m in history]
    return sum(values[:5]) / 5, sum(values[-5:]) / 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="grpo")
    parser.add_argument("--seeds", type=seeds, default=seeds("0-2"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--task", default="target_char", help="--data.task")
    parser.add_argument("--threshold", type=float, default=0.08, help="a 3-seed mean gain to count triples under")
    args = parser.parse_args()
    gains = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as root:
            history = Trainer(
                trainer=TrainerConfig(max_steps=args.steps, seed=seed, default_root_dir=root,
                                      enable_progress_bar=False, save_final=False),
                data=DataConfig(task=args.task), algorithm=ALGORITHMS[args.algorithm](),
            ).fit().history
        first, last = first_last(history, "reward/mean")
        row = {"seed": seed, "first5": round(first, 4), "last5": round(last, 4), "gain": round(last - first, 4)}
        if "critic/value_mean" in history[0]:
            value_first, value_last = first_last(history, "critic/value_mean")
            row["value_gain"] = round(value_last - value_first, 4)
        gains.append(last - first)
        print(json.dumps(row), flush=True)
    summary: dict[str, float] = {"mean_gain": round(statistics.mean(gains), 4)}
    if len(gains) > 1:
        summary["sd_gain"] = round(statistics.stdev(gains), 4)
    if len(gains) >= 3:
        triples = [sum(c) / 3 for c in itertools.combinations(gains, 3)]
        summary["triples_under_threshold"] = round(sum(t < args.threshold for t in triples) / len(triples), 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
