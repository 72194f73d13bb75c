"""Weight-sync seconds and GB/s of the ``vllm`` engine: same process (in-memory ``reload_weights``)
vs separate process (``--engine.separate_process``: broadcast buckets over gloo/NCCL), side by side.

For each model size both engines are alive at once and syncs alternate A B A B; medians printed.
Models are built from a Qwen2-style config with random weights (the character tokenizer).

    python benchmarks/vllm_sync.py --sizes tiny,large --repeats 5 --bucket_mb 512
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from gcore import ModelConfig
from gcore.model import ModelSource, char_tokenizer, materialize

SIZES = {  # hidden, layers, heads, kv heads, intermediate
    "tiny": (128, 4, 4, 2, 512),  # the embedded default policy
    "large": (1024, 16, 16, 4, 4096),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="tiny,large")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket_mb", type=float, default=512.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from gcore.engines.vllm import VLLMEngine

    device = torch.device(args.device)
    rows = []
    for size in args.sizes.split(","):
        hidden, layers, heads, kv, inter = SIZES[size]
        config = ModelConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=512)
        path = materialize(config, char_tokenizer(), 0, tempfile.mkdtemp())
        weights = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(device).state_dict()
        gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
        params_m = sum(t.numel() for t in weights.values()) / 1e6
        engines = {
            "same process": VLLMEngine(enforce_eager=True, max_model_len=512),
            "separate process": VLLMEngine(enforce_eager=True, max_model_len=512, separate_process=True,
                                           sync_bucket_mb=args.bucket_mb),
        }
        for engine in engines.values():
            engine.setup(ModelSource(path), device)
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        for _name, engine in engines.items():  # warm-up
            engine.update_weights(weights.items())
        for _ in range(args.repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.update_weights(weights.items())
                seconds[name].append(time.perf_counter() - start)
        for name, engine in engines.items():
            buckets = engine.sender.last_buckets if engine.sender is not None else "-"
            median = statistics.median(seconds[name])
            rows.append((size, f"{params_m:.0f}M", f"{gb:.3f}", name, buckets, median, gb / median))
            engine.shutdown()
    print(f"device {device}, float32, {args.repeats} syncs each after one warm-up (medians), "
          f"bucket {args.bucket_mb} MiB")
    print(f"{'model':<7}{'params':>8}{'GB':>8}  {'sync':<18}{'buckets':>8}{'s':>9}{'GB/s':>8}")
    for size, params, gb, name, buckets, s, gbps in rows:
        print(f"{size:<7}{params:>8}{gb:>8}  {name:<18}{buckets!s:>8}{s:>9.3f}{gbps:>8.2f}")


if __name__ == "__main__":
    main()
