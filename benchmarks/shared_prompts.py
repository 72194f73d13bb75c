"""Training forward+backward with each distinct prompt run once vs the plain forward, by prompt length (CPU).

A GRPO micro-batch holds each prompt ``n`` times. ``gcore.backends.shared_prompts`` runs it once and the
responses on its keys and values, padded to the longest (``shared``) or packed into one sequence under a block
mask (``packed``, ``--backend.pack_responses``). This times one step's policy forward+backward over the batch
(micro-batches of 32 rows) the three ways, alternating, for several prompt lengths, and prints the ratios.
``--uneven``: response lengths drawn uniformly from 1 to ``--response-length`` (what packing is for);
``--model-path``: a local HF checkpoint instead of the embedded tiny model.

    python benchmarks/shared_prompts.py --prompt-lengths 2,16,64,256 --response-length 32 --repeats 5
    python benchmarks/shared_prompts.py --model-path /tmp/smollm2-hf --prompt-lengths 60 --response-length 24 \
        --uneven --prompts 4 --micro-batch-size 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gcore.backends import sequence_parallel as seqpar
from gcore.backends.shared_prompts import (
    distinct_prompts,
    packed_response_logits,
    shared_prompt_logits,
    to_batch_layout,
    to_response_layout,
)
from gcore.model import ModelConfig, build_tiny_model, char_tokenizer
from gcore.types import Prompt, Sample, collate


def batch_of(prompts: int, n: int, prompt_length: int, response_length: int, seed: int, uneven: bool = False):
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(prompts):
        prompt = Prompt(index=group, text="",
                        token_ids=torch.randint(5, 90, (prompt_length,), generator=generator).tolist())
        for _ in range(n):
            drawn = int(torch.randint(1, response_length + 1, (1,), generator=generator))
            length = drawn if uneven else response_length
            response = torch.randint(5, 90, (length,), generator=generator).tolist()
            samples.append(Sample(prompt=prompt, group=group, response_ids=response,
                                  response_logprobs=[0.0] * length, response_text="", finished=False))
    return collate(samples, pad_id=0, temperature=1.0)


def plain(model, micro):
    ids, mask = micro.input_ids, micro.attention_mask
    logits = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=False).logits
    return seqpar.next_token_logprobs(logits, ids[:, 1:], 1.0)[0]


def shared(model, micro):
    logits, targets = shared_prompt_logits(model, micro, *distinct_prompts(micro), torch.device("cpu"))
    return to_batch_layout(seqpar.next_token_logprobs(logits, targets, 1.0)[0], micro)


def packed(model, micro):
    logits, targets, rows, columns = packed_response_logits(model, micro, *distinct_prompts(micro),
                                                            torch.device("cpu"))
    logprobs = seqpar.next_token_logprobs(logits, targets, 1.0)[0]
    return to_batch_layout(to_response_layout(logprobs, rows, columns, len(micro)), micro)


def step_seconds(model, batch, forward, micro_batch_size: int, groups: list[list[int]] | None = None) -> float:
    """CPU seconds of one step's forward+backward over ``batch`` in micro-batches of ``micro_batch_size`` rows in
    order, or in the micro-batches ``groups`` (lists of rows) where given."""
    start = time.process_time()
    cuts = torch.arange(len(batch)).split(micro_batch_size) if groups is None else [torch.tensor(g) for g in groups]
    for rows in cuts:
        micro = batch.select(rows)
        (forward(model, micro) * micro.response_mask).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lengths", default="2,16,64,256")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--uneven", action="store_true", help="response lengths uniform in 1..--response-length")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-path", default=None, help="a local HF checkpoint (default: the embedded model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_path:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
        name = args.model_path
    else:
        model = build_tiny_model(ModelConfig(max_position_embeddings=1024), char_tokenizer(), 0)
        name = "embedded model (4 layers, hidden 128)"
    lengths = f"1-{args.response_length} (uniform)" if args.uneven else f"{args.response_length}"
    print(f"{name}, {args.prompts} prompts x {args.n} responses of {lengths} tokens, micro-batches of "
          f"{args.micro_batch_size}, {args.threads} thread(s); CPU seconds per step's forward+backward, median of "
          f"{args.repeats} (alternating)")
    print(f"{'prompt':>7} {'plain':>8} {'shared':>8} {'packed':>8} {'shared/plain':>13} {'packed/shared':>14}")
    forwards = (plain, shared, packed)
    for prompt_length in (int(x) for x in args.prompt_lengths.split(",")):
        batch = batch_of(args.prompts, args.n, prompt_length, args.response_length, seed=prompt_length,
                         uneven=args.uneven)
        for forward in forwards:
            step_seconds(model, batch, forward, args.micro_batch_size)  # warm-up
        times: dict = {forward: [] for forward in forwards}
        for _ in range(args.repeats):
            for forward in forwards:
                times[forward].append(step_seconds(model, batch, forward, args.micro_batch_size))
        a, b, c = (statistics.median(times[forward]) for forward in forwards)
        print(f"{prompt_length:>7} {a:>8.3f} {b:>8.3f} {c:>8.3f} {b / a:>13.2f} {c / b:>14.2f}")


if __name__ == "__main__":
    main()
