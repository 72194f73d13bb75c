"""``static`` vs ``dynamic`` placement on the same GenRM workload, side by side in one run (CPU workers).

    python benchmarks/placement.py --workers 3 --steps 8

Both runs train the embedded policy with a generative judge (a tiny local LLM) on ``--workers``
engine worker processes per controller, with the same seed, prompts and sampling. ``static``
generates on all workers, swaps every worker to the judge, judges, and swaps back; ``dynamic``
splits the workers into a generation and a judge partition that run at once (each finished prompt
group is judged while the others still generate) and re-sizes the split from measured idle time.

Prints, per placement, medians over the steps after ``--warmup``: step time, the rollout phase
(generate + judge), swap time and the rest of the step (prepare + train + sync, which placement
does not change: on a loaded machine it shows how much of a step-time difference is noise), and the
idle share of the workers' time during rollout + swap,
per role (generate, judge, swap); then the dynamic/static ratios. Record the output in
BENCHMARKS.md with the date, the machine and the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch

from gcore.data import DataConfig
from gcore.model import ModelConfig, char_tokenizer, materialize
from gcore.placement.dynamic import DynamicPlacement
from gcore.placement.static import StaticPlacement
from gcore.rewards.generative import GenerativeReward
from gcore.trainer import Trainer, TrainerConfig
from gcore.types import SamplingParams


def run(placement, workers: int, judge_path: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        result = Trainer(
            trainer=TrainerConfig(max_steps=args.steps, seed=args.seed, default_root_dir=root,
                                  enable_progress_bar=False, save_final=False),
            model=ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128),
            data=DataConfig(prompts_per_step=args.prompts),
            sampling=SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens),
            reward=GenerativeReward(judge_path, verdict="yes_no", max_new_tokens=args.judge_tokens, batch_size=256),
            placement=placement,
        ).fit()
        wall = time.perf_counter() - start
    steady = result.history[args.warmup:]

    def median(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steady)

    # device-seconds of rollout + swap per step, and how much of them each role left idle
    held = [workers * (m["time/rollout"] + m["time/swap"]) for m in steady]
    share = {role: sum(m[key] for m in steady) / sum(held)
             for role, key in (("generate", "time/idle_generate"), ("judge", "time/idle_reward"))}
    share["swap"] = sum(workers * m["time/swap"] for m in steady) / sum(held)
    return {
        "step": median("time/step"),
        "rollout": median("time/rollout"),
        "swap": median("time/swap"),
        "train": statistics.median(m["time/prepare"] + m["time/train"] + m["time/sync"] for m in steady),
        "idle_generate": share["generate"],
        "idle_judge": share["judge"],
        "idle_swap": share["swap"],
        "idle": sum(share.values()),
        "judge_devices": " ".join(str(int(m.get("placement/judge_devices", workers))) for m in result.history),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3, help="engine worker processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=24, help="policy generation budget")
    parser.add_argument("--judge_tokens", type=int, default=16, help="tokens the judge writes per verdict")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dynamic_first", action="store_true", help="run dynamic before static")
    args = parser.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.workers} workers x "
          f"{args.threads} threads, {args.steps} steps ({args.warmup} warm-up), {args.prompts} prompts x {args.n} "
          f"samples x {args.max_new_tokens} tokens, judge writes {args.judge_tokens} tokens")
    with tempfile.TemporaryDirectory() as models:
        judge = materialize(ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128),
                            char_tokenizer(), seed=1, workdir=os.path.join(models, "judge"))
        placements = {
            "static": lambda: StaticPlacement(workers=args.workers, threads=args.threads),
            "dynamic": lambda: DynamicPlacement(workers=args.workers, threads=args.threads, judge_fraction=0.34,
                                                min_fraction=0.3),
        }
        order = ["dynamic", "static"] if args.dynamic_first else ["static", "dynamic"]
        rows = {name: run(placements[name](), args.workers, judge, args) for name in order}
    print("| placement | step s | rollout s | swap s | prepare+train+sync s | idle: generate | idle: judge "
          "| idle: swap | idle: all "
          "| judge workers per step | run wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['step']:.3f} | {r['rollout']:.3f} | {r['swap']:.3f} | {r['train']:.3f} | "
              f"{r['idle_generate']:.2f} | "
              f"{r['idle_judge']:.2f} | {r['idle_swap']:.2f} | {r['idle']:.2f} | {r['judge_devices']} | "
              f"{r['wall']:.0f} |")
    s, d = rows["static"], rows["dynamic"]
    print(f"\ndynamic/static: step time {d['step'] / s['step']:.2f}, rollout+swap "
          f"{(d['rollout'] + d['swap']) / (s['rollout'] + s['swap']):.2f}, idle share {d['idle'] / s['idle']:.2f}")


if __name__ == "__main__":
    main()
