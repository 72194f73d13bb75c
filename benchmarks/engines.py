"""Generation throughput and weight-sync time of the ``hf`` and ``vllm`` engines, side by side.

Same model (random weights, character tokenizer), same prompts, same sampling; the engines
alternate A B A B and the medians are printed with the vllm/hf ratio.

    python benchmarks/engines.py --hidden 512 --layers 8 --prompts 32 --n 8 --max_new_tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from gcore import HFEngine, ModelConfig, SamplingParams
from gcore.model import char_tokenizer, materialize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from gcore.engines.vllm import VLLMEngine

    tokenizer = char_tokenizer()
    config = ModelConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), intermediate_size=4 * args.hidden,
                         max_position_embeddings=1024)
    path = materialize(config, tokenizer, 0, tempfile.mkdtemp())
    device = torch.device(args.device)
    engines = {"hf": HFEngine(), "vllm": VLLMEngine(enforce_eager=device.type == "cpu", max_model_len=1024)}
    for engine in engines.values():
        engine.setup(path, device, torch.float32, False)
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(path).to(device).state_dict()
    prompts = [tokenizer(f"{i % 10}=")["input_ids"] for i in range(args.prompts)]
    # no stop token: every completion is max_new_tokens long, so both engines do the same work
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0)
    results: dict[str, dict[str, list[float]]] = {name: {"tokens_per_s": [], "sync_s": []} for name in engines}
    for name, engine in engines.items():  # warm-up
        engine.generate(prompts[:2], params)
    for _ in range(args.repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(g.token_ids) for gens in out for g in gens)
            results[name]["tokens_per_s"].append(tokens / seconds)
            start = time.perf_counter()
            engine.update_weights(weights.items())
            results[name]["sync_s"].append(time.perf_counter() - start)
    params_m = sum(t.numel() for t in weights.values()) / 1e6
    print(f"device {device}, model {params_m:.1f}M params, {args.prompts} prompts x {args.n} x {args.max_new_tokens} tokens")
    print(f"{'metric':<16}{'hf':>12}{'vllm':>12}{'vllm/hf':>10}")
    for metric in ("tokens_per_s", "sync_s"):
        hf = statistics.median(results["hf"][metric])
        vl = statistics.median(results["vllm"][metric])
        print(f"{metric:<16}{hf:>12.3f}{vl:>12.3f}{vl / hf:>10.2f}")


if __name__ == "__main__":
    main()
