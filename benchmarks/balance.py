"""Balanced versus round-robin assignment of prompts to 2 controllers, long-tailed response lengths.

Every prompt is three characters (``"<c>7="``); its first character sets how many tokens its
responses take (``BudgetEngine`` below, an ``hf`` engine that samples each prompt's completions up
to that prompt's own budget, without stopping early), and the budgets are long-tailed: most
prompts answer in 2-8 tokens, a few in 128-256. Prompt lengths are all equal, so only the response
lengths learnt from the run's history tell the balancer which prompts are expensive.

Runs ``gcore fit --trainer.devices 2`` with ``--data.balance true`` and ``false``, alternating
A B A B, and prints per-step medians (the first steps, before anything is learnt, are dropped):
step time, imbalance (slowest controller's busy time over the mean), predicted imbalance, and
micro-batch padding, with the balanced/round-robin ratios.

    python benchmarks/balance.py --steps 10 --repeats 2
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

from gcore.engines.hf import HFEngine

KEYS = ("time/step", "time/imbalance", "balance/predicted_imbalance", "padding_frac", "time/generate", "time/train",
        "response_length/mean")
BUDGET_CLASSES = 8  # budgets 2, 4, ..., 256 tokens


def budget(first_token: int) -> int:
    return 2 ** (1 + first_token % BUDGET_CLASSES)


class BudgetEngine(HFEngine):
    """Samples every prompt's completions to exactly the prompt's own budget (set by its first token)."""

    def setup(self, *args, **kwargs) -> None:
        super().setup(*args, **kwargs)
        self.eos_ids = ()  # no early stop: the response length is the budget

    def generate(self, prompts, params):
        out: list = [None] * len(prompts)
        by_budget: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_budget.setdefault(min(budget(p[0]), params.max_new_tokens), []).append(i)
        for length, rows in by_budget.items():
            fixed = dataclasses.replace(params, max_new_tokens=length, stop_token_ids=())
            for i, generations in zip(rows, super().generate([prompts[i] for i in rows], fixed), strict=False):
                out[i] = generations
        return out


def write_prompts(path: str, count: int, seed: int) -> None:
    from gcore.model import char_tokenizer

    tokenizer = char_tokenizer()
    by_class: dict[int, list[str]] = {}
    for char in "abcdefghijklmnopqrstuvwxyz":
        (first, *_) = tokenizer(char, add_special_tokens=False)["input_ids"]
        by_class.setdefault(first % BUDGET_CLASSES, []).append(char)
    rng = random.Random(seed)
    weights = [1.0 / (c + 1) ** 1.6 for c in range(BUDGET_CLASSES)]  # long tail of long budgets
    with open(path, "w") as f:
        for _ in range(count):
            cls = rng.choices(range(BUDGET_CLASSES), weights)[0]
            digit = str(rng.randrange(10))
            f.write(json.dumps({"prompt": rng.choice(by_class[cls]) + digit + "=", "answer": digit}) + "\n")


def run(root: str, data: str, balance: bool, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
           "--trainer.max_steps", str(args.steps), "--trainer.enable_progress_bar", "false",
           "--trainer.save_final", "false", "--trainer.default_root_dir", root, "--data.path", data,
           "--data.prompts_per_step", str(args.prompts), "--data.balance", str(balance).lower(),
           "--engine", "balance.BudgetEngine", "--model.max_position_embeddings", "512",
           "--sampling.n", "4", "--sampling.max_new_tokens", str(2**BUDGET_CLASSES),
           "--backend.micro_batch_size", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    versions = sorted(os.listdir(os.path.join(root, "gcore")), key=lambda v: int(v.split("_")[1]))
    with open(os.path.join(root, "gcore", versions[-1], "metrics.csv")) as f:
        rows = list(csv.DictReader(f))[args.warmup:]
    return {k: statistics.median(float(r[k]) for r in rows) for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps dropped (lengths not learnt yet)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (few distinct prompts repeat "
                        "often, so per-prompt history is learnt within the run)")
    parser.add_argument("--num-prompts", type=int, default=48)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    data = os.path.join(root, "prompts.jsonl")
    write_prompts(data, args.num_prompts, seed=0)
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for balance in (True, False):
            results[balance].append(run(os.path.join(root, "runs"), data, balance, args))
    print(f"{args.prompts} prompts/step from {args.num_prompts}, n=4, budgets 2-{2**BUDGET_CLASSES} tokens, "
          f"{args.repeats} repeats x {args.steps} steps (first {args.warmup} dropped), medians")
    print(f"{'metric':<30}{'balanced':>10}{'round-robin':>13}{'ratio':>8}")
    for key in KEYS:
        b = statistics.median(r[key] for r in results[True])
        rr = statistics.median(r[key] for r in results[False])
        print(f"{key:<30}{b:>10.3f}{rr:>13.3f}{(b / rr if rr else float('nan')):>8.2f}")


if __name__ == "__main__":
    main()
