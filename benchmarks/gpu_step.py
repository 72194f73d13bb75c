"""GPU step budget: one GRPO step of a Qwen2.5-0.5B-shaped model, engine offloaded vs kept resident.

Builds the model from the public Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
MLP 4864) with random weights and gcore's character tokenizer (no hub needed), then runs the same
fit twice per repeat, alternating: ``StaticPlacement(offload=True)`` (engine sleeps during
training) and ``offload=False``. Prints per-stage medians and the ratio. ``--compare cuda_graphs`` alternates
the ``hf`` engine's CUDA-graph decode (``HFEngine(cuda_graphs=True)``, the default) with its eager decode
instead, both resident.

    python benchmarks/gpu_step.py --steps 6 --repeats 2
    python benchmarks/gpu_step.py --steps 6 --repeats 2 --compare cuda_graphs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from gcore import DataConfig, HFEngine, ModelConfig, SamplingParams, StaticPlacement, Trainer, TrainerConfig

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, max_position_embeddings=4096)
STAGES = ("generate", "reward", "swap", "prepare", "train", "sync", "step")


def run(variant: bool, args) -> dict[str, float]:
    """One fit; ``variant`` is the first setting of ``--compare`` (offloading, or CUDA graphs) when true."""
    offload = variant if args.compare == "offload" else False
    graphs = variant if args.compare == "cuda_graphs" else True
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as root:
        result = Trainer(
            trainer=TrainerConfig(max_steps=args.steps, accelerator="cuda", precision=args.precision,
                                  default_root_dir=root, enable_progress_bar=False, save_final=False),
            model=ModelConfig(**QWEN25_05B),
            data=DataConfig(prompts_per_step=args.prompts),
            sampling=SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens),
            placement=StaticPlacement(offload=offload),
            engine=HFEngine(cuda_graphs=graphs),
        ).fit()
    steady = result.history[1:]  # the first step pays CUDA/kernel warm-up
    out = {stage: statistics.median(m[f"time/{stage}"] for m in steady) for stage in STAGES}
    tokens = statistics.median(m["response_length/mean"] * m["samples/total"] for m in steady)
    out["gen_tokens_per_s"] = tokens / out["generate"]
    out["sync_gb_per_s"] = statistics.median(m["sync/gb_per_s"] for m in steady)
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["reward_last"] = result.history[-1]["reward/mean"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--compare", choices=["offload", "cuda_graphs"], default="offload")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", vars(args))
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for variant in (True, False):  # A B A B
            runs[variant].append(run(variant, args))
    keys = [*STAGES, "gen_tokens_per_s", "sync_gb_per_s", "peak_gib", "reward_last"]
    names = ("offload", "resident") if args.compare == "offload" else ("graphs", "eager")
    print(f"{'metric':<18}{names[0]:>12}{names[1]:>12}{'ratio':>8}")
    for key in keys:
        a = statistics.median(r[key] for r in runs[True])
        b = statistics.median(r[key] for r in runs[False])
        print(f"{key:<18}{a:>12.4f}{b:>12.4f}{(a / b if b else float('nan')):>8.2f}")


if __name__ == "__main__":
    main()
