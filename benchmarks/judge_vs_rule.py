"""The same policy trained by a generative judge and by the rule reward, over seeds: held-out accuracy.

    gcore import $GGUF /tmp/smollm2-hf          # SmolLM2-135M-Instruct (docs/real_models.md)
    python benchmarks/judge_vs_rule.py --model /tmp/smollm2-hf --judge /tmp/smollm2-hf --seeds 0 1 2 --steps 8

Each run is ``examples/real_model/grpo_smollm2_compare.yaml`` (GRPO on the compare task, held-out
evaluation at the last step) with ``--reward math`` (the rule: the number after "The answer is" is
right) or ``--reward generative`` (the judge, the default probability verdict, asked whether the
response matches the reference answer). Runs alternate rule, judge per seed. Printed per run: the
held-out greedy and sampled accuracy after training, the mean training reward, and the seconds; then
per reward the mean over seeds. The untrained model's accuracy is the baseline (``--steps 0`` is not
run: the rule-trained and judge-trained runs are compared with each other and with BENCHMARKS.md's
before-training figure). Record the output in BENCHMARKS.md with the date, the machine and the load.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "real_model" / "grpo_smollm2_compare.yaml"


def run(reward: list[str], seed: int, args: argparse.Namespace, root: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "gcore", "fit", "--config", str(CONFIG), "--model.path", args.model,
               "--trainer.max_steps", str(args.steps), "--trainer.eval_every", str(args.steps),
               "--trainer.seed", str(seed), "--trainer.default_root_dir", str(root),
               "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false", *reward]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(reward)}, seed {seed}):\n{done.stderr[-3000:]}")
    rows = list(csv.DictReader(next(root.rglob("metrics.csv")).open()))
    evals = [r for r in rows if r.get("eval/accuracy_greedy")]
    return {"greedy": float(evals[-1]["eval/accuracy_greedy"]), "sampled": float(evals[-1]["eval/accuracy_sampled"]),
            "reward": statistics.mean(float(r["reward/mean"]) for r in rows if r.get("reward/mean")),
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--judge", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="/tmp/gcore-judge-vs-rule")
    args = parser.parse_args()
    rewards = {"rule": ["--reward", "math"],
               "judge": ["--reward", "generative", "--reward.path", args.judge, "--reward.batch_size", "32"]}
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {args.steps} steps, seeds {args.seeds}")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in rewards}
    for seed in args.seeds:
        for name, reward in rewards.items():
            result = run(reward, seed, args, Path(args.out) / f"{name}-{seed}")
            results[name].append(result)
            print(f"  {name:<6} seed {seed}: held-out greedy {result['greedy']:.3f}, sampled {result['sampled']:.3f}, "
                  f"train reward {result['reward']:.3f}, {result['seconds']:.0f} s", flush=True)
    for name, runs in results.items():
        print(f"{name:<6} mean over {len(runs)} seeds: greedy {statistics.mean(r['greedy'] for r in runs):.3f}, "
              f"sampled {statistics.mean(r['sampled'] for r in runs):.3f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
