"""Step time and peak memory (RSS) per rank of the megatron backend on the embedded tiny MoE model, at expert
parallel size 1 and 2 (docs/moe.md, "Megatron expert parallelism"; results in benchmarks/results/megatron_moe.md).

Each configuration runs in fresh processes (Fabric ``ddp_spawn`` on the CPU, gloo): every rank sets the backend up on
the same Qwen3-MoE checkpoint and trains ``--steps`` GRPO steps (``backend.train``: old log-probabilities are not
recomputed, the forward + backward + AdamW step of one mini-batch) on its own synthetic batch of ``--rows`` rows of
``--length`` tokens; the first step is dropped, the median of the rest printed with the rank's peak RSS.

    python benchmarks/megatron_moe.py --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time


def measure(fabric, model_dir: str, ep: int, args: argparse.Namespace, out: str) -> None:
    import torch

    from gcore import GRPO
    from gcore.backends.megatron import MegatronBackend
    from gcore.model import ModelSource
    from gcore.testing import make_batch, set_up

    rank = fabric.global_rank
    backend = MegatronBackend(expert_parallel_size=ep, micro_batch_size=args.micro_batch_size, lr=1e-3)
    backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    algorithm = set_up(GRPO(kl_coef=0.0), args.rows)
    times = []
    for step in range(args.steps):
        batch = make_batch([float(i % 2) for i in range(args.rows)], [i // 2 for i in range(args.rows)],
                           length=args.length)
        batch.input_ids = torch.randint(4, 100, batch.input_ids.shape,
                                        generator=torch.Generator().manual_seed(step * 10 + rank))
        batch.advantages = GRPO(kl_coef=0.0).advantages(batch)
        start = time.perf_counter()
        backend.train(batch, algorithm)
        times.append(time.perf_counter() - start)
    result = {"ep": ep, "ranks": fabric.world_size, "rank": rank,
              "optimizer": type(backend.optimizer.optimizer).__name__,
              "local_experts_per_layer": sum(1 for n, _ in backend.policy.named_parameters()
                                             if "layers.0.mlp.experts" in n and n.endswith("linear_fc1.weight")),
              "local_params_mib": round(sum(p.numel() * p.element_size() for p in backend.policy.parameters())
                                        / 2**20, 1),
              "step_s_median": round(statistics.median(times[1:]), 4),
              "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    from lightning_fabric import Fabric

    from gcore import ModelConfig
    from gcore.model import char_tokenizer, materialize

    with tempfile.TemporaryDirectory() as root:
        model_dir = materialize(ModelConfig(architecture="qwen3_moe", num_hidden_layers=args.layers,
                                            hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                                            num_experts=args.num_experts, num_experts_per_tok=2,
                                            moe_intermediate_size=args.hidden_size),
                                char_tokenizer(), 0, os.path.join(root, "model"))
        for ep, ranks in ((1, 1), (1, 2), (2, 2)):
            out = os.path.join(root, f"ep{ep}-ranks{ranks}")
            Fabric(accelerator="cpu", devices=ranks, strategy="ddp_spawn").launch(measure, model_dir, ep, args, out)
            for rank in range(ranks):
                with open(f"{out}.{rank}") as f:
                    print(json.dumps(json.load(f)), flush=True)


if __name__ == "__main__":
    main()
