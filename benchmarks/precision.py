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

``--stages MODEL_DIR`` times the two stages alone on fixed work instead (no training run, so every configuration
does exactly the same work): the ``hf`` engine sampling ``--rows`` rows of ``--new-tokens`` tokens from one prompt of
``--prompt-tokens`` tokens, in float32 and in bfloat16; and one forward and backward of the model in float32 on those
rows, without and with ``torch.autocast("cpu", torch.bfloat16)`` (what ``--trainer.precision bf16-mixed`` does);
best of ``--repeats``, alternated:

    python benchmarks/precision.py --stages /tmp/smollm2-hf
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
    evals = [k for k in rows[0] if k.startswith("eval/accuracy")] if rows else []
    return {
        "step": statistics.median(column(timed, "time/step")),
        "generate": statistics.median(column(timed, "time/generate")),
        "train": statistics.median(column(timed, "time/train")),
        "logprob_diff": statistics.median(column(rows, "rollout/logprob_diff") or [float("nan")]),
        "reward": [round(statistics.mean(reward[i: i + window]), 3) for i in range(0, len(reward), window)],
        "eval": {k: column(rows, k)[-1] for k in evals if column(rows, k)},
    }


def stages(model_dir: str, rows: int, prompt_tokens: int, new_tokens: int, repeats: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from gcore import HFEngine, SamplingParams
    from gcore.model import ModelSource

    prompt = list(range(100, 100 + prompt_tokens))
    params = SamplingParams(n=rows, max_new_tokens=new_tokens, temperature=1.0)  # no stop token: every row is full
    engines = {}
    for dtype in ("float32", "bfloat16"):
        engines[dtype] = HFEngine(dtype=dtype)  # type: ignore[arg-type]
        engines[dtype].setup(ModelSource(model_dir), torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(100, 1000, (rows, prompt_tokens + new_tokens), generator=torch.Generator().manual_seed(0))

    def generate(dtype: str) -> None:
        engines[dtype].generate([prompt], params)

    def train(autocast: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, use_cache=False).logits
        torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).mean().backward()
        model.zero_grad(set_to_none=True)

    cases = {"generate float32": lambda: generate("float32"), "generate bfloat16": lambda: generate("bfloat16"),
             "train float32": lambda: train(False), "train bf16 autocast": lambda: train(True)}
    best = {name: float("inf") for name in cases}
    for case in cases.values():
        case()  # warm-up
    for _ in range(repeats):
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{model_dir}: {rows} rows, prompt {prompt_tokens} tokens, {new_tokens} new tokens, torch threads "
          f"{torch.get_num_threads()}, best of {repeats}; load after {os.getloadavg()[0]:.2f}")
    for name, seconds in best.items():
        base = best["generate float32" if name.startswith("generate") else "train float32"]
        print(f"  {name:20s} {seconds:.3f} s ({seconds / base:.2f}x)")


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
    parser.add_argument("--stages", metavar="MODEL_DIR", help="time the stages alone on fixed work (see above)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=59)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.stages:
        stages(args.stages, args.rows, args.prompt_tokens, args.new_tokens, args.repeats)
        return
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
