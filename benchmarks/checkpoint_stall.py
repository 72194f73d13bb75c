"""Step-time stall of asynchronous versus synchronous checkpoints, same model, one run.

Trains a Qwen2-style model (random weights) with the torch backend and saves a checkpoint after
every step, alternating async and sync saves; the stall is the time ``CheckpointManager.save``
blocks the training loop. Prints medians and the async/sync ratio.

    python benchmarks/checkpoint_stall.py --hidden 768 --layers 12 --repeats 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from lightning_fabric import Fabric

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.checkpoint import CheckpointManager
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import make_batch, set_up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    config = ModelConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), intermediate_size=4 * args.hidden)
    path = materialize(config, char_tokenizer(), 0, f"{root}/model")
    backend = TorchBackend(lr=1e-4)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=False)
    manager = CheckpointManager(f"{root}/ckpt", keep_last=2)
    batch = make_batch([1.0, 0.0, 0.5, 0.25], [0, 0, 1, 1], length=32)
    batch.input_ids = torch.randint(4, 90, batch.input_ids.shape)
    batch.advantages = GRPO(kl_coef=0.0).advantages(batch)
    stalls: dict[bool, list[float]] = {True: [], False: []}
    steps: dict[bool, list[float]] = {True: [], False: []}
    backend.train(batch, set_up(GRPO(kl_coef=0.0), 31))  # warm-up: optimizer state exists before the first save
    step = 0
    for _ in range(args.repeats):
        for asynchronous in (True, False):
            start = time.perf_counter()
            stalls[asynchronous].append(manager.save(step, backend.state_dict(), {"step": step}, {},
                                                     asynchronous=asynchronous))
            backend.train(batch, set_up(GRPO(kl_coef=0.0), 31))  # the next step runs while an async save writes
            manager.poll()
            steps[asynchronous].append(time.perf_counter() - start)
            manager.wait()
            step += 1
    size = sum(t.numel() * t.element_size() for _, t in backend.named_weights()) * 3 / 1e9  # weights + Adam
    print(f"model {size / 3 * 1e3 / 4:.0f}M params, checkpoint about {size:.2f} GB (weights + Adam moments)")
    print(f"{'metric (median s)':<26}{'async':>10}{'sync':>10}{'ratio':>8}")
    for name, data in (("stall in save()", stalls), ("save + next train step", steps)):
        a, s = statistics.median(data[True]), statistics.median(data[False])
        print(f"{name:<26}{a:>10.3f}{s:>10.3f}{a / s:>8.2f}")


if __name__ == "__main__":
    main()
