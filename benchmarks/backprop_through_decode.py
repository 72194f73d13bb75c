"""Is one forward pass per update enough? Backpropagating through the sampled decode vs a second, training forward.

On-policy GRPO with one gradient step per batch (``--algorithm.epochs 1 --algorithm.mini_batches 1``, no KL) has a
ratio of exactly 1 at its only step, so its gradient is the plain policy gradient ``sum(A * grad log p)``. The
log-probabilities of the sampled tokens are already computed while decoding; with autograd on during the decode
the update could backpropagate through the decode itself and skip the training forward that gcore and TRL both run
(a third of the training FLOPs). This measures whether that is faster on this machine, on the tiny model of
``benchmarks/vs_trl.py`` (16 prompts x 8 samples, 2-token prompts, 16 new tokens), both ways in eager PyTorch with
the model's own forward and KV cache:

- ``separate``: decode without autograd, then forward and backward of the 128 rows in micro-batches of 32 (as a
  trainer does);
- ``through_decode``: decode with autograd on, then one backward through every decode step;
- ``decode_only``: the decode without autograd (what both share).

    python benchmarks/backprop_through_decode.py --repeats 7

Prints the best and median seconds of each, alternated, and the ratio ``through_decode / separate``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    args = parser.parse_args()

    # gcore first: its thread defaults apply before torch starts its threads
    from gcore.model import ModelConfig, char_tokenizer, materialize  # noqa: I001
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.manual_seed(0)
    path = materialize(ModelConfig(), char_tokenizer(), 1, tempfile.mkdtemp(prefix="gcore-decode-"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    rows, new = args.rows, args.new_tokens
    prompt = torch.randint(3, model.config.vocab_size, (rows, 2))
    advantages = torch.randn(rows, 1)

    def decode(grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``new`` tokens per row; the sampled tokens and their log-probabilities ``[rows, new]``."""
        with torch.set_grad_enabled(grad):
            cache = DynamicCache(config=model.config)
            logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            tokens, logprobs = [], []
            for t in range(new):
                logp = torch.log_softmax(logits, -1)
                chosen = torch.multinomial(logp.detach().exp(), 1).squeeze(-1)
                tokens.append(chosen)
                logprobs.append(logp.gather(-1, chosen[:, None]).squeeze(-1))
                if t + 1 < new:
                    logits = model(input_ids=chosen[:, None], past_key_values=cache, use_cache=True,
                                   position_ids=torch.full((rows, 1), prompt.shape[1] + t)).logits[:, -1]
        return torch.stack(tokens, 1), torch.stack(logprobs, 1)

    def separate() -> None:
        tokens, _ = decode(False)
        ids = torch.cat([prompt, tokens], 1)
        for start in range(0, rows, args.micro_batch_size):
            micro = ids[start: start + args.micro_batch_size]
            logits = model(input_ids=micro[:, :-1], use_cache=False).logits[:, prompt.shape[1] - 1:]
            logprobs = torch.log_softmax(logits, -1).gather(-1, micro[:, prompt.shape[1]:, None]).squeeze(-1)
            (-(logprobs * advantages[start: start + args.micro_batch_size]).sum() / rows).backward()

    def through_decode() -> None:
        _, logprobs = decode(True)
        (-(logprobs * advantages).sum() / rows).backward()

    def decode_only() -> None:
        decode(False)

    ways = (separate, through_decode, decode_only)
    for way in ways:  # warm-up
        way()
    seconds: dict[str, list[float]] = {way.__name__: [] for way in ways}
    for _ in range(args.repeats):
        for way in ways:
            start = time.perf_counter()
            way()
            seconds[way.__name__].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    print(f"{rows} rows x {new} new tokens, micro-batches of {args.micro_batch_size}, torch threads "
          f"{torch.get_num_threads()}, {args.repeats} alternated repeats")
    for name, values in seconds.items():
        print(f"  {name:15s} best {min(values):.4f} s, median {statistics.median(values):.4f} s")
    ratio = statistics.median(seconds["through_decode"]) / statistics.median(seconds["separate"])
    print(f"  through_decode / separate (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
