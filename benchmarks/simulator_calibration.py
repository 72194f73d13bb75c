"""Calibrate `gcore simulate` against real CPU runs, and check it on a held-out setting.

Runs the real trainer (`gcore fit`, GRPO, a generative judge on the `hf` engine, static placement)
for a small grid of settings, reads the per-stage times from each run's metrics.csv, fits the
simulator's per-token costs on some settings, and compares the simulator's predicted per-stage times
(generate, reward/judge, train, swap) with the measured ones on a setting left out of the fit.

    python benchmarks/simulator_calibration.py --measure examples/simulate/cpu_measurements.json
    python benchmarks/simulator_calibration.py --check examples/simulate/cpu_measurements.json \
        --write-yaml examples/simulate/genrm_cpu_calibrated.yaml

`--measure` takes a few minutes on a 2-core CPU (one torch thread per run); `--check` takes a second.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# prompts per step, samples per prompt, policy max_new_tokens, judge max_new_tokens
FIT = [(4, 4, 16, 8), (8, 4, 48, 8), (4, 4, 48, 24), (8, 4, 16, 24), (6, 4, 24, 12)]
HELD_OUT = [(6, 4, 32, 16), (10, 4, 40, 4)]
JUDGE_BATCH = 16
STAGES = ("generate", "reward", "train", "swap")


def run_setting(prompts: int, n: int, new_tokens: int, judge_tokens: int, steps: int, judge: str, root: str) -> str:
    """One real `gcore fit` run; returns its run folder."""
    args = [
        sys.executable, "-m", "gcore", "fit",
        "--trainer.max_steps", str(steps), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.seed", "1", "--trainer.default_root_dir", root, "--trainer.logger", "csv",
        "--trainer.enable_progress_bar", "false",
        "--data.prompts_per_step", str(prompts), "--sampling.n", str(n),
        "--sampling.max_new_tokens", str(new_tokens),
        "--reward", "generative", "--reward.path", judge, "--reward.verdict", "yes_no",
        "--reward.max_new_tokens", str(judge_tokens),
        "--reward.batch_size", str(JUDGE_BATCH),
        "--placement", "static", "--placement.offload", "true",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(args, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"gcore fit failed:\n{result.stderr[-3000:]}")
    versions = sorted(os.listdir(os.path.join(root, "gcore")), key=lambda v: int(v.split("_")[1]))
    return os.path.join(root, "gcore", versions[-1])


def read_steps(run_dir: str, warmup: int) -> list[dict[str, float]]:
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]
    return rows[warmup:]


def measure(path: str, steps: int, warmup: int, rounds: int) -> None:
    """Runs every setting ``rounds`` times, alternating settings, and keeps each stage's per-step times.

    The machine is shared, so a stage's time is its fastest step over all rounds (the least
    disturbed one); the medians are kept in the file too.
    """
    from gcore.model import ModelConfig, char_tokenizer, materialize
    from gcore.rewards.generative import DEFAULT_TEMPLATE

    work = tempfile.mkdtemp(prefix="gcore_calibration_")
    judge = materialize(ModelConfig(), char_tokenizer(), seed=1, workdir=os.path.join(work, "judge"))
    # the judge reads the template with the prompt ("7=") and the answer ("7") filled in, then the response
    template_tokens = len(DEFAULT_TEMPLATE.format(prompt="7=", answer="7", response=""))
    grid = FIT + HELD_OUT
    steps_seen: dict[tuple, list[dict[str, float]]] = {key: [] for key in grid}
    for round_ in range(rounds):
        for key in grid:
            run_dir = run_setting(*key, steps, judge, os.path.join(work, "runs"))
            steps_seen[key] += read_steps(run_dir, warmup)
            print(f"round {round_ + 1}/{rounds}: {key} done", flush=True)
    settings = []
    for key in grid:
        prompts, n, new_tokens, judge_tokens = key
        rows = steps_seen[key]
        stage = {
            "generate": [r["time/generate"] for r in rows],
            "reward": [r["time/reward"] for r in rows],
            "train": [r["time/train"] + r["time/prepare"] for r in rows],
            "swap": [r["time/swap"] for r in rows],
        }
        settings.append({
            "prompts": prompts, "n": n, "max_new_tokens": new_tokens, "judge_output_tokens": judge_tokens,
            "judge_batch": JUDGE_BATCH, "prompt_tokens": 2, "judge_template_tokens": template_tokens,
            "response_max": max(r["response_length/max"] for r in rows),
            "response_mean": statistics.mean(r["response_length/mean"] for r in rows),
            "measured": {k: min(v) for k, v in stage.items()},
            "median": {k: statistics.median(v) for k, v in stage.items()},
            "held_out": key in HELD_OUT,
            "steps_used": len(rows),
        })  # fmt: skip
        print(settings[-1], flush=True)
    with open(path, "w") as f:
        meta = {"steps": steps, "warmup": warmup, "rounds": rounds, "statistic": "min over steps", "settings": settings}
        json.dump(meta, f, indent=1)
    print(f"measurements: {path}")


def check(path: str, tolerance: float, write_yaml: str | None) -> int:
    from gcore.simulator.calibration import Setting, calibrated_workload, fit_costs, predict_stages, workload_yaml

    with open(path) as f:
        data = json.load(f)
    settings = [Setting.from_dict(s) for s in data["settings"]]
    fit_on = [s for s in settings if not s.held_out]
    costs = fit_costs(fit_on)
    print("fitted costs (s):", ", ".join(f"{k}={v:.3g}" for k, v in costs.items()))
    print(f"{'setting':<22} {'stage':<9} {'measured':>9} {'predicted':>9} {'error':>7}  {'use'}")
    worst = 0.0
    for s in settings:
        predicted = predict_stages(calibrated_workload(costs, s), s)
        for stage in STAGES:
            measured, guess = s.measured[stage], predicted[stage]
            # swap is ~0 on CPU (nothing to offload); compare it in absolute seconds
            error = abs(guess - measured) / measured if stage != "swap" else abs(guess - measured)
            if s.held_out and stage != "swap":
                worst = max(worst, error)
            label = f"B={s.prompts * s.n} L={s.max_new_tokens} J={s.judge_output_tokens}"
            shown = f"{error:7.1%}" if stage != "swap" else f"{error:6.3f}s"
            print(f"{label:<22} {stage:<9} {measured:9.3f} {guess:9.3f} {shown}  {'held out' if s.held_out else 'fit'}")
    ok = worst <= tolerance
    print(f"held-out worst relative error (generate, reward, train): {worst:.1%} "
          f"-> {'within' if ok else 'OUTSIDE'} the {tolerance:.0%} tolerance")
    if write_yaml:
        with open(write_yaml, "w") as f:
            f.write(workload_yaml(costs, source=path))
        print(f"calibrated workload: {write_yaml}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", metavar="JSON", help="run the real trainer on the grid and write measurements")
    parser.add_argument("--check", metavar="JSON", help="fit on the fit settings, check the held-out ones")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out (shape warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every setting, alternating settings")
    parser.add_argument("--tolerance", type=float, default=0.25, help="largest held-out relative error accepted")
    parser.add_argument("--write-yaml", help="write the calibrated simulator workload here")
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.steps, args.warmup, args.rounds)
    if args.check:
        return check(args.check, args.tolerance, args.write_yaml)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
