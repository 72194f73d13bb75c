"""Precision on CPU: float32 against bfloat16 generation (``--engine.init_args.dtype bfloat16``), bfloat16 autocast
in training (``--trainer.precision bf16-mixed``, Fabric's autocast) and both, on the same workload, alternated.

Every run is ``gcore fit`` in a fresh process with the same options and seed, then one of the configurations below;
the script reads the run's ``metrics.csv`` and prints, per configuration, the median step / generate / train seconds
(the first ``--warmup`` steps left out), the median ``rollout/logprob_diff`` (mean |trainer - engine| log-probability
of the sampled tokens: how far the bfloat16 engine's distribution is from the trained one), the training reward over
windows of steps, and the last held-out evaluation when the options ask for one. Ratios are to ``fp32`` of the same
seed and round.

    python benchmarks/precision.py --rounds 2 --steps 12                      # the embedded tiny model
    python benchmarks/precision.py --seeds 0,1 --steps 20 -- --config examples/real_model/grpo_smollm2_compare.yaml \\
        --model.path /tmp/smollm2-hf --trainer.eval_every 0

Options after ``--`` go to every ``gcore fit``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "fp32": [],
    "bf16-engine": ["--engine.init_args.dtype", "bfloat16"],
    "bf16-mixed": ["--trainer.precision", "bf16-mixed"],
    "bf16-both": ["--engine.init_args.dtype", "bfloat16", "--trainer.precision", "bf16-mixed"],
}


def run(config: str, seed: int, steps: int, extra: list[str], root: str) -> list[dict[str, str]]:
    out = os.path.join(root, f"{config}-{seed}-{time.monotonic_ns()}")
    command = [sys.executable, "-m", "gcore", "fit", *extra, "--trainer.max_steps", str(steps), "--trainer.seed",
               str(seed), "--trainer.default_root_dir", out, "--trainer.enable_progress_bar", "false",
               "--trainer.save_final", "false", *CONFIGS[config]]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    (path,) = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files if f == "metrics.csv"]
    with open(path) as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def summary(rows: list[dict[str, str]], warmup: int, window: int) -> dict[str, object]:
    timed = rows[warmup:]
    reward = column(rows, "reward/mean")
    evals = [k for k in rows[0] if k.startswith("eval/") and k.endswith("accuracy")] if rows else []
    return {
        "step": statistics.median(column(timed, "time/step")),
        "generate": statistics.median(column(timed, "time/generate")),
        "train": statistics.median(column(timed, "time/train")),
        "logprob_diff": statistics.median(column(rows, "rollout/logprob_diff") or [float("nan")]),
        "reward": [round(statistics.mean(reward[i: i + window]), 3) for i in range(0, len(reward), window)],
        "eval": {k: column(rows, k)[-1] for k in evals if column(rows, k)},
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="fp32,bf16-engine,bf16-mixed,bf16-both",
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--seeds", default="42")
    parser.add_argument("--rounds", type=int, default=1, help="repeats of every seed's alternation")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timings")
    parser.add_argument("--window", type=int, default=5, help="steps per reward window")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    for config in configs:
        if config not in CONFIGS:
            parser.error(f"--configs: unknown {config!r}; valid: {', '.join(CONFIGS)}")
    print(f"gcore fit {' '.join(extra)} --trainer.max_steps {args.steps}; load before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="gcore-precision-") as root:
        for seed in (int(s) for s in args.seeds.split(",")):
            for r in range(args.rounds):
                base = None
                for config in configs:
                    s = summary(run(config, seed, args.steps, extra, root), args.warmup, args.window)
                    base = s if config == configs[0] else base
                    assert base is not None
                    print(f"seed {seed} round {r} {config:11s} step {s['step']:.3f} s ({s['step'] / base['step']:.2f}x)"
                          f"  generate {s['generate']:.3f} ({s['generate'] / base['generate']:.2f}x)"
                          f"  train {s['train']:.3f} ({s['train'] / base['train']:.2f}x)"
                          f"  logprob_diff {s['logprob_diff']:.4f}  reward by {args.window} steps {s['reward']}"
                          f"  {s['eval'] or ''}  load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
