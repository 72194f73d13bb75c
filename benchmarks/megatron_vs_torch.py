"""One full GRPO step, torch backend (DDP) vs megatron backend, side by side in one run.

Each configuration runs as its own ``gcore`` fit in a fresh process (Fabric launches its ranks
there), alternating A B A B; the script prints per-stage medians over steady-state steps (the
first step of each fit is dropped) and the megatron / torch ratio.

    # CPU (default: the embedded tiny model, 1 process)
    python benchmarks/megatron_vs_torch.py --steps 4 --repeats 2
    # CPU, 2 processes: megatron at DP=2 uses its distributed optimizer (or --pp 2: two pipeline stages)
    python benchmarks/megatron_vs_torch.py --devices 2 --steps 4 --repeats 2
    # GPU: a Qwen2.5-0.5B-shaped model, 2 GPUs, megatron at tensor parallel size 2
    python benchmarks/megatron_vs_torch.py --model qwen2.5-0.5b --accelerator cuda --devices 2 --tp 2 \
        --precision bf16-mixed --max_new_tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

STAGES = ("generate", "prepare", "train", "sync", "step")
MODELS = {
    "tiny": dict(),
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, max_position_embeddings=4096),
}


def fit_once(args: argparse.Namespace) -> None:
    """Child process: one fit with one backend; writes the per-step metrics as JSON."""
    from gcore import DataConfig, ModelConfig, SamplingParams, Trainer, TrainerConfig
    from gcore.backends.megatron import MegatronBackend
    from gcore.backends.torch import TorchBackend

    backend = (MegatronBackend(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                               micro_batch_size=args.micro_batch_size)
               if args.one == "megatron" else TorchBackend(micro_batch_size=args.micro_batch_size))
    with tempfile.TemporaryDirectory() as root:
        result = Trainer(
            trainer=TrainerConfig(max_steps=args.steps, accelerator=args.accelerator, devices=args.devices,
                                  precision=args.precision, default_root_dir=root, enable_progress_bar=False,
                                  save_final=False),
            model=ModelConfig(**MODELS[args.model]),
            data=DataConfig(prompts_per_step=args.prompts),
            sampling=SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens),
            backend=backend,
        ).fit()
    if result.run_dir is not None or int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(result.history, f)


def run(backend: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        child = [sys.executable, os.path.abspath(__file__), "--one", backend, "--out", out.name]
        for key in ("steps", "model", "accelerator", "devices", "tp", "pp", "precision", "prompts", "n",
                    "max_new_tokens", "micro_batch_size"):
            child += [f"--{key}", str(getattr(args, key))]
        subprocess.run(child, check=True, stdout=subprocess.DEVNULL)
        with open(out.name) as f:
            history = json.load(f)
    steady = history[1:]
    result = {stage: statistics.median(m[f"time/{stage}"] for m in steady) for stage in STAGES}
    result["reward_last"] = history[-1]["reward/mean"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="megatron tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="megatron pipeline parallel size")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--micro_batch_size", type=int, default=32)
    parser.add_argument("--one", choices=["torch", "megatron"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        fit_once(args)
        return
    import torch

    print(f"torch {torch.__version__}", {k: v for k, v in vars(args).items() if k not in ("one", "out")})
    runs: dict[str, list[dict[str, float]]] = {"torch": [], "megatron": []}
    for _ in range(args.repeats):
        for backend in ("torch", "megatron"):  # A B A B
            runs[backend].append(run(backend, args))
    dp = args.devices // (args.tp * args.pp)
    optimizer = "distributed optimizer" if dp > 1 else "AdamW"
    print(f"| metric (median s) | torch (DDP) | megatron (TP={args.tp}, PP={args.pp}, DP={dp}, {optimizer}) "
          "| megatron / torch |")
    print("| --- | ---: | ---: | ---: |")
    for key in (*STAGES, "reward_last"):
        a = statistics.median(r[key] for r in runs["torch"])
        b = statistics.median(r[key] for r in runs["megatron"])
        print(f"| {key} | {a:.3f} | {b:.3f} | {b / a if a else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
