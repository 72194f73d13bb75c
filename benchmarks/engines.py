"""Generation throughput, start-up time and weight-sync time of the rollout engines, side by side.

Same model (random weights, character tokenizer), same prompts, same sampling (no stop token: every
completion is ``max_new_tokens`` long, so every engine does the same work). The engines given
alternate A B A B and the medians are printed; ``--json`` appends one line per engine to a file, so
that engines living in different virtual environments (vLLM's and SGLang's CPU builds each need
their own) can be run one after the other and put in one table.

    python benchmarks/engines.py --engines hf vllm --hidden 512 --layers 8 --prompts 32 --n 8 --max_new_tokens 64
    python benchmarks/engines.py --engines hf sglang --threads 1 --json engines.jsonl
    python benchmarks/engines.py --engines hf vllm --model-path smollm2 --prompts 8 --n 4 --max_new_tokens 48

``--model-path DIR`` benchmarks a real checkpoint instead (e.g. SmolLM2-135M-Instruct made by ``gcore
import``, docs/real_models.md): its own tokenizer, the arithmetic task's prompts wrapped in its chat
template, and completions that end at its EOS token as in training, so each engine's completions
differ in length; tokens/s counts the tokens each engine generated, and the mean completion length is
printed beside it.

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
from gcore.data import DataConfig, load_prompts
from gcore.engines.base import Engine
from gcore.model import ModelSource, char_tokenizer, materialize


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
    parser.add_argument("--model-path", default=None,
                        help="a checkpoint folder to benchmark (default: a random model of --hidden x --layers)")
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

    if args.model_path is None:
        tokenizer = char_tokenizer()
        config = ModelConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                             intermediate_size=4 * args.hidden, max_position_embeddings=1024)
        path = materialize(config, tokenizer, 0, tempfile.mkdtemp())
        prompts = [tokenizer(f"{i % 10}=")["input_ids"] for i in range(args.prompts)]
    else:
        from transformers import AutoTokenizer

        path = args.model_path
        tokenizer = AutoTokenizer.from_pretrained(path)
        data = DataConfig(task="arithmetic", chat_template=True, num_synthetic_prompts=args.prompts)
        prompts = [p.token_ids for p in load_prompts(data, tokenizer, args.max_new_tokens, None)]
    device = torch.device(args.device)
    engines: dict[str, Engine] = {}
    results: dict[str, dict[str, list[float]]] = {}
    for name in args.engines:
        engine = make_engine(name, device, args.threads, 1024)
        start = time.perf_counter()
        engine.setup(ModelSource(path), device)
        engines[name] = engine
        results[name] = {"startup_s": [time.perf_counter() - start], "tokens_per_s": [], "sync_s": [],
                         "mean_len": []}
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(path).to(device).state_dict()
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
            results[name]["mean_len"].append(tokens / sum(len(gens) for gens in out))
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

    unique = {t.data_ptr(): t for t in weights.values()}.values()  # tied embeddings count once
    params_m = sum(t.numel() for t in unique) / 1e6
    sync_gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9  # what the sync sends
    print(f"device {device}, threads {args.threads or torch.get_num_threads()}, model {args.model_path or 'random'}"
          f" {params_m:.1f}M params, "
          f"{args.prompts} prompts x {args.n} x {args.max_new_tokens} tokens, median of {args.repeats}")
    metrics = ("startup_s", "tokens_per_s", "mean_len", "sync_s", "swap_s")
    print(f"{'metric':<16}" + "".join(f"{name:>12}" for name in engines))
    for metric in metrics:
        cells = [statistics.median(results[n][metric]) if results[n].get(metric) else float("nan") for n in engines]
        print(f"{metric:<16}" + "".join(f"{c:>12.3f}" for c in cells))
    if args.json:
        with open(args.json, "a") as f:
            for name in engines:
                row = {"engine": name, "threads": args.threads, "model": args.model_path,
                       "params_m": round(params_m, 2), "sync_gb": sync_gb,
                       "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
                       **{m: statistics.median(v) for m, v in results[name].items() if v}}
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
