"""On-policy distillation against GRPO with the rule reward, at the same steps, over seeds: held-out accuracy.

    gcore import $GGUF /tmp/smollm2-hf          # SmolLM2-135M-Instruct (docs/real_models.md)
    python benchmarks/distill_learning.py --model /tmp/smollm2-hf --teacher-steps 24 --steps 8 --seeds 0 1 2

Issue 51, item 3's campaign, on ``examples/real_model/grpo_smollm2_compare.yaml`` (the compare task, held-out
evaluation before the first step and after the last):

1. the teacher: gcore trains SmolLM2-135M-Instruct with GRPO and the rule reward (``--reward math``) for
   ``--teacher-steps`` steps (seed ``--teacher-seed``) and saves it (``final/``); its held-out accuracy is printed;
2. per seed, the same student (the untrained model) for ``--steps`` steps, twice: ``grpo`` (the rule reward, as
   the teacher was trained) and ``distill`` (``--algorithm distill --algorithm.teacher`` the teacher: the reverse
   KL to it alone, ``reward_weight`` 0; the rule reward is still computed and logged, not trained on). With
   ``--teacher-engine`` the teacher runs on an ``hf`` engine of its own (``--algorithm.teacher_engine hf``)
   instead of in the trainer.

Printed per run: held-out greedy and sampled accuracy before and after, the mean training reward, the first and
last ``distill/reverse_kl`` (distill runs), the seconds; then per setting the means over seeds. ``--fit-args``
are passed to every run (after the config), e.g. a smoke run's smaller batches. Record the output in
benchmarks/results/distillation.md with the date, the machine and the load.
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


def fit(args: argparse.Namespace, root: Path, steps: int, seed: int, extra: list[str], save: bool) -> list[str]:
    return [sys.executable, "-m", "gcore", "fit", "--config", str(CONFIG), "--model.path", args.model,
            "--trainer.max_steps", str(steps), "--trainer.eval_every", str(steps), "--trainer.seed", str(seed),
            "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
            "--trainer.save_final", "true" if save else "false", *extra, *args.fit_args]


def run(command: list[str], what: str, root: Path) -> dict[str, float]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({what}):\n{done.stderr[-3000:]}")
    rows = list(csv.DictReader(next(root.rglob("metrics.csv")).open()))
    evals = [r for r in rows if r.get("eval/accuracy_greedy")]
    steps = [r for r in rows if r.get("reward/mean")]
    kl = [float(r["distill/reverse_kl"]) for r in steps if r.get("distill/reverse_kl")]
    return {"greedy_before": float(evals[0]["eval/accuracy_greedy"]),
            "sampled_before": float(evals[0]["eval/accuracy_sampled"]),
            "greedy_after": float(evals[-1]["eval/accuracy_greedy"]),
            "sampled_after": float(evals[-1]["eval/accuracy_sampled"]),
            "reward": statistics.mean(float(r["reward/mean"]) for r in steps),
            "kl_first": kl[0] if kl else float("nan"), "kl_last": kl[-1] if kl else float("nan"),
            "seconds": time.perf_counter() - started}


def show(name: str, r: dict[str, float]) -> str:
    return (f"{name:>16}: greedy {r['greedy_before']:.3f} -> {r['greedy_after']:.3f}, sampled "
            f"{r['sampled_before']:.3f} -> {r['sampled_after']:.3f}, reward {r['reward']:.3f}, reverse KL "
            f"{r['kl_first']:.3f} -> {r['kl_last']:.3f}, {r['seconds']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the student (and the teacher's start): an HF checkpoint")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8, help="the student's steps, distill and GRPO alike")
    parser.add_argument("--teacher-steps", type=int, default=24, help="GRPO steps that make the teacher")
    parser.add_argument("--teacher-seed", type=int, default=100)
    parser.add_argument("--teacher", default="", help="a teacher made before (its HF folder): no teacher run")
    parser.add_argument("--teacher-engine", action="store_true", help="the teacher on an hf engine of its own")
    parser.add_argument("--out", default="/tmp/gcore-distill-learning")
    parser.add_argument("--fit-args", nargs=argparse.REMAINDER, default=[],
                        help="passed to every gcore fit (last on the command line)")
    args = parser.parse_args()
    out = Path(args.out)
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; teacher {args.teacher or args.teacher_steps}, "
          f"student steps {args.steps}, seeds {args.seeds}, teacher engine {args.teacher_engine}, "
          f"fit args {args.fit_args}", flush=True)
    teacher = args.teacher
    if not teacher:
        root = out / "teacher"
        result = run(fit(args, root, args.teacher_steps, args.teacher_seed, [], save=True), "teacher", root)
        teacher = str(next(p for p in root.rglob("final") if (p / "config.json").is_file()))
        print(show("teacher (GRPO)", result), flush=True)
        print(f"teacher: {teacher}", flush=True)
    settings = {"grpo": [],
                "distill": ["--algorithm", "distill", "--algorithm.teacher", teacher,
                            *(["--algorithm.teacher_engine", "hf"] if args.teacher_engine else [])]}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    for seed in args.seeds:
        for name, extra in settings.items():
            root = out / f"{name}-{seed}"
            result = run(fit(args, root, args.steps, seed, extra, save=False), f"{name}, seed {seed}", root)
            results[name].append(result)
            print(show(f"{name} seed {seed}", result), flush=True)
    for name, runs in results.items():
        mean = {key: statistics.mean(r[key] for r in runs) for key in runs[0]}
        print(show(f"{name} mean", mean), flush=True)


if __name__ == "__main__":
    main()
