"""Decode throughput of the ``hf`` engine on a GPU: ``model.generate`` vs gcore's own sampling loop with a
growing ``DynamicCache`` vs the static-KV decoder, eager and replayed as a CUDA graph.

The model is built from a public shape with random weights and its real vocabulary size (the LM head is
a large share of a small model's decode), saved to a temporary directory and loaded by every engine the
way a run loads it. No stop token: every row generates ``--max-new-tokens`` tokens, so every mode does
the same work. The modes alternate A B C D A B C D and the medians are printed with the ratio to
``generate``. ``generate+static`` is transformers' own answer (``cache_implementation="static"``, which
compiles the forward); it is left out unless asked for because its compilation takes minutes.

Before timing, greedy decoding in float32 checks that the CUDA-graph decoder gives the eager static
decoder's tokens (the share of equal tokens is printed).

    python benchmarks/gpu_decode.py --model qwen2.5-0.5b --dtype bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from gcore import HFEngine, SamplingParams
from gcore.model import ModelSource

SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                         tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         tie_word_embeddings=True),
}
MODES = {  # name: HFEngine keyword arguments
    "generate": dict(use_generate=True),
    "dynamic": dict(static_cache=False),
    "static": dict(cuda_graphs=False),
    "graphs": dict(cuda_graphs=True),
}


def checkpoint(shape: str, workdir: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, max_position_embeddings=4096,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(workdir)
    return workdir


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--modes", default="generate,dynamic,static,graphs",
                        help=f"comma-separated, of {', '.join([*MODES, 'generate+static'])}")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (rows = prompts x n)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    modes = args.modes.split(",")
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", vars(args), flush=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 30000, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0)
    with tempfile.TemporaryDirectory() as workdir:
        path = checkpoint(args.model, workdir)

        # correctness first: greedy float32 tokens of the graph replay vs the eager static decoder
        greedy = SamplingParams(n=2, max_new_tokens=min(64, args.max_new_tokens), temperature=0.0)
        outputs = []
        for graphs in (False, True):
            engine = HFEngine(cuda_graphs=graphs, dtype="float32")
            engine.setup(ModelSource(path), device)
            outputs.append([g.token_ids for group in engine.generate(prompts[:4], greedy) for g in group])
            engine.shutdown()
        same = sum(a == b for x, y in zip(*outputs, strict=True) for a, b in zip(x, y, strict=True))
        total = sum(len(x) for x in outputs[0])
        print(f"greedy float32, graphs vs eager static decoder: {same}/{total} tokens equal", flush=True)

        engines = {}
        for mode in modes:
            if mode == "generate+static":
                engines[mode] = HFEngine(use_generate=True, dtype=args.dtype)
            else:
                engines[mode] = HFEngine(dtype=args.dtype, **MODES[mode])
            engines[mode].setup(ModelSource(path), device)

        def run(mode: str) -> None:
            engine = engines[mode]
            if mode != "generate+static":
                engine.generate(prompts, params)
                return
            ids = torch.tensor([p for p in prompts for _ in range(args.n)], device=device)
            engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                  max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                                  cache_implementation="static", pad_token_id=0)

        for mode in modes:  # warm-up: kernels, cuBLAS plans, graph capture, compilation
            print(f"warm-up {mode}: {timed(lambda mode=mode: run(mode)):.2f} s", flush=True)
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode in modes:
                seconds[mode].append(timed(lambda mode=mode: run(mode)))
        rows = args.prompts * args.n
        tokens = rows * args.max_new_tokens
        base = statistics.median(seconds[modes[0]])
        print(f"{args.model} {args.dtype}: {rows} rows x {args.max_new_tokens} new tokens after a "
              f"{args.prompt_tokens}-token prompt, median of {args.repeats}, peak GPU memory "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        print(f"{'mode':<18}{'median s':>10}{'tokens/s':>12}{'ms/token step':>15}{'vs ' + modes[0]:>14}")
        for mode in modes:
            median = statistics.median(seconds[mode])
            print(f"{mode:<18}{median:>10.3f}{tokens / median:>12.0f}{1000 * median / args.max_new_tokens:>15.2f}"
                  f"{base / median:>13.2f}x")


if __name__ == "__main__":
    main()
