"""Generation throughput, start-up time and weight-sync time of the rollout engines, side by side.

Same model (random weights, character tokenizer), same prompts, same sampling (no stop token: every
completion is ``max_new_tokens`` long, so every engine does the same work). The engines given
alternate A B A B and the medians are printed; ``--json`` appends one line per engine to a file, so
that engines living in different virtual environments (vLLM's and SGLang's CPU builds each need
their own) can be run one after the other and put in one table.

    python benchmarks/engines.py --engines hf vllm --hidden 512 --layers 8 --prompts 32 --n 8 --max_new_tokens 64
    python benchmarks/engines.py --engines hf sglang --threads 1 --json engines.jsonl

``--threads`` sets the OpenMP threads of every engine: torch's in this process (hf, and vLLM's
in-process engine core, which also gets ``VLLM_CPU_OMP_THREADS_BIND``) and SGLang's scheduler
process (``--engine.cpu_threads``). For SGLang on CPU the cost of a placement swap (``sleep`` ends
its processes, ``wake_up`` starts them again) is measured too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from gcore import HFEngine, ModelConfig, SamplingParams
from gcore.engines.base import Engine
from gcore.model import char_tokenizer, materialize


def make_engine(name: str, device: torch.device, threads: int | None, max_len: int) -> Engine:
    if name == "hf":
        return HFEngine()
    if name == "vllm":
        from gcore.engines.vllm import VLLMEngine

        if threads is not None and device.type == "cpu":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        return VLLMEngine(enforce_eager=device.type == "cpu", max_model_len=max_len)
    if name == "sglang":
        from gcore.engines.sglang import SGLangEngine

        return SGLangEngine(context_length=max_len, cpu_threads=threads)
    raise SystemExit(f"unknown engine {name!r}; valid choices: hf, vllm, sglang")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads per engine (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="append one JSON line per engine to this file")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    tokenizer = char_tokenizer()
    config = ModelConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), intermediate_size=4 * args.hidden,
                         max_position_embeddings=1024)
    path = materialize(config, tokenizer, 0, tempfile.mkdtemp())
    device = torch.device(args.device)
    engines: dict[str, Engine] = {}
    results: dict[str, dict[str, list[float]]] = {}
    for name in args.engines:
        engine = make_engine(name, device, args.threads, 1024)
        start = time.perf_counter()
        engine.setup(path, device, torch.float32, False)
        engines[name] = engine
        results[name] = {"startup_s": [time.perf_counter() - start], "tokens_per_s": [], "sync_s": []}
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(path).to(device).state_dict()
    prompts = [tokenizer(f"{i % 10}=")["input_ids"] for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0)
    for engine in engines.values():  # warm-up
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
    if "sglang" in engines and device.type == "cpu":  # a placement swap: processes ended, started again
        engine = engines["sglang"]
        start = time.perf_counter()
        engine.sleep()
        engine.wake_up()
        engine.update_weights(weights.items())
        results["sglang"]["swap_s"] = [time.perf_counter() - start]
    for engine in engines.values():
        engine.shutdown()

    params_m = sum(t.numel() for t in weights.values()) / 1e6
    sync_gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    print(f"device {device}, threads {args.threads or torch.get_num_threads()}, model {params_m:.1f}M params, "
          f"{args.prompts} prompts x {args.n} x {args.max_new_tokens} tokens, median of {args.repeats}")
    metrics = ("startup_s", "tokens_per_s", "sync_s", "swap_s")
    print(f"{'metric':<16}" + "".join(f"{name:>12}" for name in engines))
    for metric in metrics:
        cells = [statistics.median(results[n][metric]) if results[n].get(metric) else float("nan") for n in engines]
        print(f"{metric:<16}" + "".join(f"{c:>12.3f}" for c in cells))
    if args.json:
        with open(args.json, "a") as f:
            for name in engines:
                row = {"engine": name, "threads": args.threads, "params_m": round(params_m, 2), "sync_gb": sync_gb,
                       "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
                       **{m: statistics.median(v) for m, v in results[name].items() if v}}
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
