"""Calibrate `gcore simulate` against real CPU runs, and check it on a held-out setting.

Runs the real trainer (`gcore fit`, GRPO, a generative judge on the `hf` engine, static placement)
for a small grid of settings, reads the per-stage times from each run's metrics.csv, fits the
simulator's per-token costs on some settings, and compares the simulator's predicted per-stage times
(generate, reward/judge, train, swap) with the measured ones on a setting left out of the fit.

    python benchmarks/simulator_calibration.py --measure examples/simulate/cpu_measurements.json
    python benchmarks/simulator_calibration.py --check examples/simulate/cpu_measurements.json \
        --write-yaml examples/simulate/genrm_cpu_calibrated.yaml

`--workload smollm2` measures issue 31's workload instead (benchmarks/placement_shift.py): SmolLM2-135M-Instruct
as policy and judge, the ``mixed`` task in the chat template with every prompt judged (the routed reward,
judged share 1), the judge's ``probability`` verdict (one forward pass over the judge prompt, no decoding),
and a short and a long judge template; its grid varies samples per step, ``max_new_tokens`` and the template:

    python benchmarks/simulator_calibration.py --workload smollm2 --policy /tmp/smollm2-hf --judge /tmp/smollm2-hf \
        --steps 4 --warmup 1 --rounds 1 --measure examples/simulate/smollm2_judge_measurements.json
    python benchmarks/simulator_calibration.py --check examples/simulate/smollm2_judge_measurements.json \
        --write-yaml examples/simulate/smollm2_judge_calibrated.yaml

`--measure` takes a few minutes on a 2-core CPU (one torch thread per run; about 15 minutes for
``smollm2``); `--check` takes a second.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # placement_shift

# prompts per step, samples per prompt, policy max_new_tokens, judge max_new_tokens
FIT = [(4, 4, 16, 8), (8, 4, 48, 8), (4, 4, 48, 24), (8, 4, 16, 24), (6, 4, 24, 12)]
HELD_OUT = [(6, 4, 32, 16), (10, 4, 40, 4)]
JUDGE_BATCH = 16
STAGES = ("generate", "reward", "train", "swap")

# --workload smollm2: prompts per step, samples per prompt, policy max_new_tokens, judge template
SMOLLM2_FIT = [(2, 4, 8, "short"), (4, 4, 8, "long"), (2, 4, 32, "long"), (4, 4, 24, "short"), (3, 4, 16, "long")]
SMOLLM2_HELD_OUT = [(3, 4, 24, "short"), (4, 4, 16, "long")]
SMOLLM2_JUDGE_BATCH = 64  # as benchmarks/placement_shift.py: one judge call per step
RUBRIC = ("You are a careful grader. Read the task and the response below. A good response answers the task "
          "directly, stays on the subject, is coherent and complete, does not repeat itself, and contains no "
          "gibberish or unrelated text. Ignore style and length: judge only whether the response does what the "
          "task asks, and whether a reader would find it useful. Think about it before you answer.\n\n")


def smollm2_templates() -> dict[str, str]:
    from placement_shift import JUDGE_TEMPLATE

    return {"short": JUDGE_TEMPLATE, "long": RUBRIC + JUDGE_TEMPLATE}


def run_smollm2_setting(prompts: int, n: int, new_tokens: int, template: str, steps: int, policy: str, judge: str,
                        root: str) -> str:
    """One real `gcore fit` run of issue 31's workload with every prompt judged; returns its run folder."""
    from placement_shift import routed_reward

    reward = json.loads(routed_reward(judge, smollm2_templates()[template]))
    reward["init_args"]["routes"]["judge"]["init_args"]["batch_size"] = SMOLLM2_JUDGE_BATCH
    args = [
        sys.executable, "-m", "gcore", "fit", "--model.path", policy,
        "--trainer.max_steps", str(steps), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.seed", "1", "--trainer.default_root_dir", root, "--trainer.logger", "csv",
        "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false",
        "--data.task", "mixed", "--data.task_judged_share", "[1.0, 1.0]", "--data.shuffle", "false",
        "--data.chat_template", "true", "--data.num_synthetic_prompts", str(steps * prompts),
        "--data.prompts_per_step", str(prompts), "--sampling.n", str(n), "--sampling.max_new_tokens", str(new_tokens),
        "--reward", json.dumps(reward), "--placement", "static", "--placement.offload", "true",
    ]  # fmt: skip
    return _fit(args, root)


def smollm2_token_counts(prompts: int, steps: int, new_tokens: int, template: str, policy: str,
                         judge: str) -> tuple[int, int]:
    """Mean tokens of the policy's prompts and of the judge's prompts with an empty response, over the
    prompts the run sees (the judge prompt in the judge's chat template, as ``GenerativeReward`` builds it)."""
    from transformers import AutoTokenizer

    from gcore.data import DataConfig, load_prompts

    config = DataConfig(task="mixed", task_judged_share=(1.0, 1.0), shuffle=False, chat_template=True,
                        num_synthetic_prompts=steps * prompts, prompts_per_step=prompts)
    rows = load_prompts(config, AutoTokenizer.from_pretrained(policy), new_tokens, None)
    judge_tokenizer = AutoTokenizer.from_pretrained(judge)
    reads = []
    for p in rows:
        text = smollm2_templates()[template].format(prompt=p.text, response="", answer="")
        text = judge_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)
        reads.append(len(judge_tokenizer(text, add_special_tokens=False)["input_ids"]))
    return round(statistics.mean(len(p.token_ids) for p in rows)), round(statistics.mean(reads))


def _fit(args: list[str], root: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(args, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"gcore fit failed:\n{result.stderr[-3000:]}")
    versions = sorted(os.listdir(os.path.join(root, "gcore")), key=lambda v: int(v.split("_")[1]))
    return os.path.join(root, "gcore", versions[-1])


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
    return _fit(args, root)


KEPT = ("time/generate", "time/reward", "time/train", "time/prepare", "time/swap", "response_length/max",
        "response_length/mean")  # the metrics.csv columns kept per step in the measurements file


def read_steps(run_dir: str, warmup: int) -> list[dict[str, float]]:
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = [{k: float(v) for k, v in row.items() if k in KEPT and v not in ("", None)} for row in csv.DictReader(f)]
    return rows[warmup:]


def measure(path: str, steps: int, warmup: int, rounds: int, workload: str = "tiny", policy: str | None = None,
            judge_path: str | None = None, extend: bool = False) -> None:
    """Runs every setting ``rounds`` times, alternating settings, and keeps each stage's per-step times.

    The machine is shared, so a stage's time is its fastest step over all rounds (the least
    disturbed one); the medians are kept in the file too, and each step's times (``rows``). With
    ``extend`` the rounds are added to the steps already in ``path`` (more rounds, run later).
    """
    work = tempfile.mkdtemp(prefix="gcore_calibration_")
    tokens: dict[tuple, tuple[int, int]] = {}
    if workload == "smollm2":
        if not policy or not judge_path:
            raise SystemExit("--workload smollm2 needs --policy and --judge (HF checkpoint folders)")
        grid: list[tuple] = SMOLLM2_FIT + SMOLLM2_HELD_OUT
        held_out: list[tuple] = SMOLLM2_HELD_OUT
        for key in grid:
            tokens[key] = smollm2_token_counts(key[0], steps, key[2], key[3], policy, judge_path)
    else:
        from gcore.model import ModelConfig, char_tokenizer, materialize
        from gcore.rewards.generative import DEFAULT_TEMPLATE

        judge = materialize(ModelConfig(), char_tokenizer(), seed=1, workdir=os.path.join(work, "judge"))
        # the judge reads the template with the prompt ("7=") and the answer ("7") filled in, then the response
        template_tokens = len(DEFAULT_TEMPLATE.format(prompt="7=", answer="7", response=""))
        grid, held_out = FIT + HELD_OUT, HELD_OUT
        tokens = {key: (2, template_tokens) for key in grid}
    steps_seen: dict[tuple, list[dict[str, float]]] = {key: [] for key in grid}
    loads: list[float] = []
    earlier_rounds = 0
    if extend:
        with open(path) as f:
            earlier = json.load(f)
        for raw in earlier["settings"]:
            judge_key = raw.get("judge_template", raw["judge_output_tokens"])
            key = (raw["prompts"], raw["n"], raw["max_new_tokens"], judge_key)
            steps_seen[key] += raw["rows"]
        loads += earlier["load_average"]
        earlier_rounds = earlier["rounds"]
    for round_ in range(rounds):
        for key in grid:
            root = os.path.join(work, "runs")
            if workload == "smollm2":
                run_dir = run_smollm2_setting(*key, steps, str(policy), str(judge_path), root)
            else:
                run_dir = run_setting(*key, steps, judge, root)
            steps_seen[key] += read_steps(run_dir, warmup)
            loads.append(os.getloadavg()[0])
            print(f"round {round_ + 1}/{rounds}: {key} done (load {loads[-1]:.2f})", flush=True)
    settings = []
    for key in grid:
        prompts, n, new_tokens, judge_key = key
        rows = steps_seen[key]
        stage = {
            "generate": [r["time/generate"] for r in rows],
            "reward": [r["time/reward"] for r in rows],
            "train": [r["time/train"] + r["time/prepare"] for r in rows],
            "swap": [r["time/swap"] for r in rows],
        }
        # the probability verdict reads the judge prompt once and writes nothing: one verdict position
        judge_tokens = 1 if workload == "smollm2" else judge_key
        setting = {
            "prompts": prompts, "n": n, "max_new_tokens": new_tokens, "judge_output_tokens": judge_tokens,
            "judge_batch": SMOLLM2_JUDGE_BATCH if workload == "smollm2" else JUDGE_BATCH,
            "prompt_tokens": tokens[key][0], "judge_template_tokens": tokens[key][1],
            "response_max": max(r["response_length/max"] for r in rows),
            "response_mean": statistics.mean(r["response_length/mean"] for r in rows),
            "measured": {k: min(v) for k, v in stage.items()},
            "median": {k: statistics.median(v) for k, v in stage.items()},
            "held_out": key in held_out,
            "steps_used": len(rows),
            "rows": rows,
        }  # fmt: skip
        if workload == "smollm2":
            setting["judge_template"] = judge_key
        settings.append(setting)
        print({k: v for k, v in setting.items() if k != "rows"}, flush=True)
    with open(path, "w") as f:
        meta = {"workload": workload, "steps": steps, "warmup": warmup, "rounds": earlier_rounds + rounds,
                "statistic": "min over steps", "load_average": [min(loads), max(loads)],
                "fit_prefill": workload == "smollm2", "settings": settings}
        json.dump(meta, f, indent=1)
    print(f"measurements: {path}")


def check(path: str, tolerance: float, write_yaml: str | None) -> int:
    from gcore.simulator.calibration import Setting, calibrated_workload, fit_costs, predict_stages, workload_yaml

    with open(path) as f:
        data = json.load(f)
    settings = [Setting.from_dict(s) for s in data["settings"]]
    fit_on = [s for s in settings if not s.held_out]
    costs = fit_costs(fit_on, prefill=data.get("fit_prefill", False))
    print("fitted costs (s):", ", ".join(f"{k}={v:.3g}" for k, v in costs.items()))
    print(f"{'setting':<26} {'stage':<9} {'measured':>9} {'predicted':>9} {'error':>7}  {'use'}")
    worst = 0.0
    held_errors: dict[str, list[float]] = {stage: [] for stage in STAGES if stage != "swap"}
    for s in settings:
        predicted = predict_stages(calibrated_workload(costs, s), s)
        for stage in STAGES:
            measured, guess = s.measured[stage], predicted[stage]
            # swap is ~0 on CPU (nothing to offload); compare it in absolute seconds
            error = abs(guess - measured) / measured if stage != "swap" else abs(guess - measured)
            if s.held_out and stage != "swap":
                worst = max(worst, error)
                held_errors[stage].append(error)
            label = f"B={s.prompts * s.n} L={s.max_new_tokens} J={s.judge_output_tokens} T={s.judge_template_tokens}"
            shown = f"{error:7.1%}" if stage != "swap" else f"{error:6.3f}s"
            print(f"{label:<26} {stage:<9} {measured:9.3f} {guess:9.3f} {shown}  {'held out' if s.held_out else 'fit'}")
    print("held-out relative error per stage (worst):",
          ", ".join(f"{stage} {max(errors):.1%}" for stage, errors in held_errors.items()))
    ok = worst <= tolerance
    print(f"held-out worst relative error (generate, reward, train): {worst:.1%} "
          f"-> {'within' if ok else 'OUTSIDE'} the {tolerance:.0%} tolerance")
    if write_yaml:
        workload = data.get("workload", "tiny")
        # the judge template's own tokens: the judge prompt with an empty response, less the policy's prompt
        own = min(s.judge_template_tokens - s.prompt_tokens for s in settings) if workload == "smollm2" else 95
        with open(write_yaml, "w") as f:
            f.write(workload_yaml(costs, source=path, workload=workload, judge_prompt_tokens=own))
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
    parser.add_argument("--workload", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny: the embedded 4-layer model; smollm2: issue 31's workload (--policy, --judge)")
    parser.add_argument("--policy", help="--workload smollm2: the policy's HF checkpoint folder")
    parser.add_argument("--judge", help="--workload smollm2: the judge's HF checkpoint folder")
    parser.add_argument("--extend", action="store_true", help="add the rounds to the steps already in --measure")
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.steps, args.warmup, args.rounds, args.workload, args.policy, args.judge,
                args.extend)
    if args.check:
        return check(args.check, args.tolerance, args.write_yaml)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
