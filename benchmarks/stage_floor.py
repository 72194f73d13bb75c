"""How far each stage of a finished run is from this machine's floor (issues 20 and 36's stage-floor table).

Reads a run's ``metrics.csv`` (``--metrics``) or every gcore run of a ``benchmarks/vs_trl.py --json`` file
(``--json``: one table per task), measures this machine's float32 matmul peak (``torch.mm`` on square matrices,
with the torch threads this process has; the bfloat16 peak is printed beside it) and its memory copy rate, and
estimates each stage's useful work from the logged counts, with the usual dense-transformer count (2 x parameters
FLOPs per token forward, 6 x for forward and backward; attention's sequence-length term is left out: these runs'
sequences are short):

- generate: each prompt group's prompt once (the engine prefills a shared prompt once) and every sample's
  response tokens, forward (KV-cached decode); floor: those FLOPs at the float32 matmul peak;
- train: forward and backward over the rows that train (``samples/trained`` x ``trained_rows_frac``: inert
  rows are skipped), a prompt once per group of them (the shared-prompt forward) and every row's response;
  floor: those FLOPs at the float32 matmul peak;
- in both, a prompt's tokens but its last run the transformer without the output head (only the last prompt
  position's logits are needed: both stages compute only those);
- sync: the bytes sent to the engine (``sync/gb``), copied once at the measured copy rate.

A second floor, ``x shapes``, is closer to what the stage can reach: the same FLOPs at the rate this machine's
matmuls reach on the model's own layer shapes (every linear layer of one block and the output head, ``M`` rows:
the decode batch for generate, a micro-batch's tokens for train). Small ``M`` (a decode step's rows) runs well
below the square-matrix peak; the gap between the two floors is the matmul shapes, the gap above ``x shapes``
is everything but the matmuls (attention, norms, softmax, sampling, padding, rows decoded after they finished).

A third, ``x roofline``, adds what the matmul peak leaves out: the weights must be read from memory. A decode step
reads every weight once whatever its rows, so a step's generation reads them once per decode step (as many as its
longest reply: ``response_length/max``); training reads them about three times per micro-batch (the forward, the
backward's input gradients, the gradient accumulation) and eight times in the optimizer (clipping, then AdamW's
parameter, gradient and two moments read, three written). The floor is then the larger of the FLOPs at the peak
and those bytes at the machine's measured read rate (``torch.sum`` over 512 MB), with the optimizer's bytes added
after the forward and backward (it runs after them); it assumes ``--weight-bytes`` per parameter (4: float32).

``prepare`` runs no model where the engine's log-probabilities are used and there is no KL term: its floor is
nothing, and the table prints its time and share of the step instead. These are estimates of useful work; the
achieved rate is a lower bound where a stage also pads or recomputes. The prompt length is the logged
``prompt_length/mean``; ``--prompt-tokens`` gives it for runs logged before that metric existed.

    python benchmarks/stage_floor.py --metrics RUN/metrics.csv --model-path /tmp/smollm2-hf
    python benchmarks/stage_floor.py --json suite.json --model-path /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch


class Roofline(NamedTuple):
    """What the ``x roofline`` floor needs besides a step's FLOPs: the weights' size, the machine's read rate and
    the training micro-batch size."""

    weight_gb: float
    read_rate: float  # GB/s
    micro_batch_size: int


def best_seconds(work: Callable[[], object], repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``work``, after one untimed warm-up call."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak_gflops(size: int = 2048, repeats: int = 10, dtype: torch.dtype = torch.float32) -> float:
    """The best of ``repeats`` ``size x size`` matmuls in ``dtype``, in GFLOP/s."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / best_seconds(partial(torch.mm, a, b), repeats) / 1e9


def layer_shapes_gflops(model: torch.nn.Module, rows: int, repeats: int = 10) -> float:
    """The rate of ``rows x in`` by ``in x out`` float32 matmuls over the distinct linear-layer shapes of ``model``
    (its first block's and the output head's, each weighted by its FLOPs), in GFLOP/s."""
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    flops = seconds = 0.0
    for inputs, outputs in sorted(shapes):
        a, b = torch.randn(rows, inputs), torch.randn(inputs, outputs)
        flops, seconds = flops + 2 * rows * inputs * outputs, seconds + best_seconds(partial(torch.mm, a, b), repeats)
    return flops / seconds / 1e9


def shape_rates(model: torch.nn.Module, rows: list[dict], micro_batch_size: int) -> dict[str, float]:
    """``layer_shapes_gflops`` at each stage's rows: generate decodes every sample of a step at once, train runs a
    micro-batch's response tokens."""
    samples = statistics.median(float(r["samples/total"]) for r in rows)
    response = statistics.median(float(r["response_length/mean"]) for r in rows)
    return {"generate": layer_shapes_gflops(model, round(samples)),
            "train": layer_shapes_gflops(model, max(1, round(min(samples, micro_batch_size) * response)))}


def copy_gb_per_s(megabytes: int = 512, repeats: int = 5) -> float:
    """The best of ``repeats`` copies of a ``megabytes`` float32 tensor into another, in GB copied per second."""
    src = torch.randn(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)  # its pages are touched by the warm-up copy
    return src.numel() * 4 / best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def read_gb_per_s(megabytes: int = 512, repeats: int = 5) -> float:
    """The best of ``repeats`` sums over a ``megabytes`` float32 tensor, in GB read per second."""
    src = torch.randn(megabytes * 2**20 // 4)
    return src.numel() * 4 / best_seconds(src.sum, repeats) / 1e9


def roofline_seconds(stage: str, flops: float, row: dict, trained: float, roof: Roofline, peak: float) -> float:
    """The ``x roofline`` floor of one step's ``stage`` (seconds; ``trained``: the rows that train): its FLOPs at
    ``peak`` or the weights' reads, whichever is longer, plus the optimizer's reads and writes for train (module
    docstring)."""
    compute, weights = flops / peak / 1e9, roof.weight_gb / roof.read_rate
    if stage == "generate":
        return max(compute, float(row["response_length/max"]) * weights)
    return max(compute, 3 * math.ceil(trained / roof.micro_batch_size) * weights) + 8 * weights


def stage_table(rows: list[dict], params: int, head: int, peak: float, shaped: dict[str, float], copy_rate: float,
                prompt_tokens: float | None, roofline: Roofline | None = None) -> None:
    """Print each stage's median time, work per step, achieved rate and time over its floor for ``rows``
    (``params``: the model's parameters, ``head``: those of its output head; ``roofline``: for the ``x roofline``
    column)."""
    work: dict[str, list[tuple[float, float]]] = {"generate": [], "train": [], "sync": []}
    roof: dict[str, list[float]] = {"generate": [], "train": []}
    prepare, steps = [], []
    for r in rows:
        samples, groups = float(r["samples/total"]), float(r["filter/groups_trained"]) or 1.0
        prompt = prompt_tokens if prompt_tokens is not None else float(r["prompt_length/mean"])
        response = float(r["response_length/mean"])
        trained = float(r["samples/trained"]) * float(r["trained_rows_frac"])
        prompt_flops = (params - head) * prompt + head  # one prompt's forward, per FLOP-count unit
        per_step = {"generate": 2 * (groups * prompt_flops + params * samples * response),  # FLOPs
                    "train": 6 * (trained / (samples / groups) * prompt_flops + params * trained * response),
                    "sync": float(r.get("sync/gb") or 0.0) * 1e9}  # bytes
        for stage, amount in per_step.items():
            seconds = float(r[f"time/{stage}"])
            if seconds > 0 and amount > 0:
                work[stage].append((amount, seconds))
                if roofline is not None and stage in roof:
                    roof[stage].append(seconds / roofline_seconds(stage, amount, r, trained, roofline, peak))
        prepare.append(float(r["time/prepare"]))
        steps.append(float(r["time/step"]))
    print(f"{'stage':<10}{'median s':>10}{'work/step':>14}{'rate':>14}{'x floor':>9}{'x shapes':>10}"
          f"{'x roofline':>12}")
    for stage, pairs in work.items():
        if not pairs:
            print(f"{stage:<10}{'-':>10}")
            continue
        amount = statistics.median(w for w, _ in pairs)
        seconds = statistics.median(s for _, s in pairs)
        rate = sum(w for w, _ in pairs) / sum(s for _, s in pairs) / 1e9
        floor_rate, unit = (copy_rate, "GB") if stage == "sync" else (peak, "GFLOP")
        near = f"{shaped[stage] / rate:>9.1f}x" if stage in shaped else ""
        over = f"{statistics.median(roof[stage]):>11.1f}x" if roof.get(stage) else ""
        print(f"{stage:<10}{seconds:>10.3f}{amount / 1e9:>10.2f} {unit:<3}{rate:>9.1f} {unit}/s"
              f"{floor_rate / rate:>8.1f}x{near}{over}")
    print(f"{'prepare':<10}{statistics.median(prepare):>10.3f}  (no model work: "
          f"{sum(prepare) / sum(steps):.1%} of the step)")
    print(f"{'step':<10}{statistics.median(steps):>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--metrics", help="a run's metrics.csv")
    source.add_argument("--json", help="a benchmarks/vs_trl.py --json file: its gcore runs, per task")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--prompt-tokens", type=float, default=None,
                        help="mean prompt length in tokens (default: the logged prompt_length/mean)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    parser.add_argument("--micro-batch-size", type=int, default=16,
                        help="rows per training micro-batch (a --json file's own setting wins)")
    parser.add_argument("--weight-bytes", type=int, default=4,
                        help="bytes per parameter for the roofline's weight reads (4: float32, 2: bfloat16)")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once: as the output head
    head = model.get_output_embeddings().weight.numel()
    peak, bf16_peak, copy_rate = matmul_peak_gflops(), matmul_peak_gflops(dtype=torch.bfloat16), copy_gb_per_s()
    read_rate = read_gb_per_s()
    print(f"model {args.model_path}: {params / 1e6:.1f}M parameters; with {torch.get_num_threads()} torch threads "
          f"the matmul peak here is {peak:.1f} GFLOP/s float32 ({bf16_peak:.1f} bfloat16), a copy "
          f"{copy_rate:.1f} GB/s, a read {read_rate:.1f} GB/s")
    weights = params * args.weight_bytes / 1e9
    if args.metrics:
        rows = [r for r in csv.DictReader(open(args.metrics)) if r.get("time/step")][args.skip:]
        print(f"{args.metrics}: {len(rows)} steps")
        stage_table(rows, params, head, peak, shape_rates(model, rows, args.micro_batch_size), copy_rate,
                    args.prompt_tokens, Roofline(weights, read_rate, args.micro_batch_size))
        return
    with open(args.json) as f:
        data = json.load(f)
    runs = data["runs"]
    by_task = runs if "none" not in runs else {data["args"].get("task", "task"): runs}
    micro = data["args"].get("micro_batch_size") or args.micro_batch_size
    for task, kinds in by_task.items():
        rows = [m for run in kinds["none"].get("gcore", []) for m in run.get("metrics", [])[args.skip:]]
        print(f"\n## {task}: {len(kinds['none'].get('gcore', []))} gcore runs, {len(rows)} steps")
        if rows:
            stage_table(rows, params, head, peak, shape_rates(model, rows, micro), copy_rate, args.prompt_tokens,
                        Roofline(weights, read_rate, micro))


if __name__ == "__main__":
    main()
