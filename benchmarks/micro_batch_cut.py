"""One step's packed training forward+backward with the rows cut into micro-batches by length vs by prompt (CPU).

``balance.micro_batches_sharing_prompts`` chooses between the two cuts; with packed replies
(``--backend.pack_responses``) both run the same reply tokens, and the cut by prompt runs each prompt once where
the cut by length runs it in every micro-batch that holds one of its rows. This times both cuts, alternating, on
``--prompts`` prompts of ``--n`` rows with uneven replies (1 to ``--response-length`` tokens), and prints the ratio.

    python benchmarks/micro_batch_cut.py --model-path /tmp/smollm2-hf --prompt-length 60 --threads 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from shared_prompts import batch_of, packed, step_seconds

from gcore.balance import micro_batches_by_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="a local HF checkpoint")
    parser.add_argument("--prompt-length", type=int, default=60)
    parser.add_argument("--response-length", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    batch = batch_of(args.prompts, args.n, args.prompt_length, args.response_length, seed=0, uneven=True)
    rows = list(range(len(batch)))  # batch_of lays the rows out prompt by prompt
    size = args.micro_batch_size
    cuts = {"length": micro_batches_by_length(batch.attention_mask.sum(-1).tolist(), size),
            "prompt": [rows[i : i + size] for i in range(0, len(rows), size)]}
    for name, groups in cuts.items():
        print(f"by {name}: prompts per micro-batch {[len({r // args.n for r in g}) for g in groups]}")

    times: dict[str, list[float]] = {name: [] for name in cuts}
    for _ in range(args.repeats):
        for name, groups in cuts.items():
            times[name].append(step_seconds(model, batch, packed, size, groups))
    for name, values in times.items():
        print(f"by {name}: median {statistics.median(values):.2f} s CPU ({', '.join(f'{v:.2f}' for v in values)})")
    print(f"by prompt / by length: {statistics.median(times['prompt']) / statistics.median(times['length']):.2f}")


if __name__ == "__main__":
    main()
