"""Reward curves over seeds of a mixture-of-experts GRPO run, with and without routing replay.

Trains the embedded tiny Qwen3-MoE (``--model.architecture qwen3_moe``, the default model's sizes otherwise) with GRPO
on the embedded default task for ``--steps`` steps per seed, in ``--dtype`` (engine and trainer alike), the ``hf``
engine recording its routes in every run (``--engine.record_routes``: the mismatch is logged with replay off too),
once with ``--backend.routing_replay false`` and once with ``true``. Writes one CSV per run (``--out``/
``<dtype>-replay-<off|on>-seed<k>.csv``: per step the mean reward, ``rollout/logprob_diff``,
``moe/router_disagrees``, ``moe/routed_differently``, ``moe/max_over_mean``, ``trained_rows_frac``) and prints one JSON
line per run: its first-5 and last-5 mean reward and the gain (the statistic of tests/trainer/test_learning.py).

    OMP_NUM_THREADS=1 python benchmarks/moe_reward_curves.py --seeds 0-2 --out benchmarks/results/raw/moe-replay-DATE
"""

import argparse
import csv
import json
import os
import statistics
import tempfile
import time

from gcore import GRPO, HFEngine, ModelConfig, TorchBackend, Trainer, TrainerConfig

COLUMNS = ("reward/mean", "rollout/logprob_diff", "moe/router_disagrees", "moe/routed_differently",
           "moe/max_over_mean", "trained_rows_frac")


def seeds(text: str) -> list[int]:
    """``0-9`` or ``0,3,5``."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def run(seed: int, replay: bool, dtype: str, steps: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as root:
        return Trainer(
            trainer=TrainerConfig(max_steps=steps, seed=seed, default_root_dir=root, enable_progress_bar=False,
                                  save_final=False),
            model=ModelConfig(architecture="qwen3_moe", dtype=dtype),  # type: ignore[arg-type]
            algorithm=GRPO(), engine=HFEngine(record_routes=True), backend=TorchBackend(routing_replay=replay),
        ).fit().history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=seeds, default=seeds("0-2"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--replay", nargs="*", default=["off", "on"], choices=("off", "on"))
    parser.add_argument("--out", required=True, help="folder for the per-run CSV files")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for replay in args.replay:
        for seed in args.seeds:
            start = time.perf_counter()
            history = run(seed, replay == "on", args.dtype, args.steps)
            path = os.path.join(args.out, f"{args.dtype}-replay-{replay}-seed{seed}.csv")
            with open(path, "w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(("step", *COLUMNS))
                for step, metrics in enumerate(history, 1):
                    writer.writerow((step, *(f"{metrics.get(k, float('nan')):.6g}" for k in COLUMNS)))
            rewards = [m["reward/mean"] for m in history]
            first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
            print(json.dumps({"dtype": args.dtype, "replay": replay, "seed": seed, "first5": round(first, 4),
                              "last5": round(last, 4), "gain": round(last - first, 4),
                              "routed_differently": round(statistics.fmean(
                                  m.get("moe/routed_differently", 0.0) for m in history), 5),
                              "s": round(time.perf_counter() - start)}), flush=True)


if __name__ == "__main__":
    main()
