"""How far each stage of a finished run is from the machine's matmul floor (issue 20's stage-floor table).

Reads a run's ``metrics.csv`` and its model, measures this machine's float32 matmul peak (``torch.mm`` on
square matrices, with the torch threads this process has), and estimates each stage's useful work from the
logged token counts with the usual dense-transformer count (2 x parameters FLOPs per token forward, 6 x for
forward and backward; attention's sequence-length term is left out: these runs' sequences are short):

- generate: each prompt group's prompt once (the engine prefills a shared prompt once) and every sample's
  response tokens, forward (KV-cached decode);
- train: forward and backward over the rows that train (``samples/trained`` x ``trained_rows_frac``: inert
  rows are skipped), a prompt once per group of them (the shared-prompt forward) and every row's response.
``prepare`` is left out: with the engine's recorded logprobs and no KL it runs no model here. These are
estimates of useful work; the achieved rate is a lower bound where a stage also pads or recomputes.

The floor of a stage is its FLOPs at the measured peak; the table prints the achieved GFLOP/s and the
stage's time over its floor. ``metrics.csv`` does not record prompt lengths: give ``--prompt-tokens``, the
mean chat-templated prompt length of the task's prompts.

    python benchmarks/stage_floor.py --metrics RUN/metrics.csv --model-path /tmp/smollm2-hf --prompt-tokens 60
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch


def matmul_peak_gflops(size: int = 2048, repeats: int = 10) -> float:
    """The best of ``repeats`` float32 ``size x size`` matmuls, in GFLOP/s."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--prompt-tokens", type=float, required=True, help="mean prompt length in tokens")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once: as the output head
    rows = [r for r in csv.DictReader(open(args.metrics)) if r.get("time/step")][args.skip:]
    peak = matmul_peak_gflops()
    print(f"model {args.model_path}: {params / 1e6:.1f}M parameters; float32 matmul peak here "
          f"{peak:.1f} GFLOP/s with {torch.get_num_threads()} torch threads; {len(rows)} steps")
    stages: dict[str, list[tuple[float, float]]] = {"generate": [], "train": []}
    for r in rows:
        samples, groups = float(r["samples/total"]), float(r["filter/groups_trained"])
        response = float(r["response_length/mean"])
        trained = float(r["samples/trained"]) * float(r["trained_rows_frac"])
        flops = {"generate": 2 * params * (groups * args.prompt_tokens + samples * response),
                 "train": 6 * params * (trained / (samples / groups) * args.prompt_tokens + trained * response)}
        for stage, work in flops.items():
            seconds = float(r[f"time/{stage}"])
            if seconds > 0 and work > 0:
                stages[stage].append((work, seconds))
    print(f"{'stage':<10}{'median s':>10}{'GFLOP/step':>12}{'GFLOP/s':>10}{'x floor':>9}")
    for stage, pairs in stages.items():
        if not pairs:
            print(f"{stage:<10}{'-':>10}")
            continue
        work = statistics.median(w for w, _ in pairs)
        seconds = statistics.median(s for _, s in pairs)
        achieved = sum(w for w, _ in pairs) / sum(s for _, s in pairs) / 1e9
        print(f"{stage:<10}{seconds:>10.3f}{work / 1e9:>12.1f}{achieved:>10.1f}{peak / achieved:>9.1f}")


if __name__ == "__main__":
    main()
