"""Long context: peak memory per rank and step time against sequence length, with and without
sequence parallelism, in one run.

For every length, one forward + backward pass (per-token log-probabilities of one sequence, summed)
of the embedded tiny model (4 layers, hidden 128, 4 attention / 2 key-value heads) runs in fresh
processes:

- ``K=1``: one rank, the torch backend's path without sequence parallelism (transformers' SDPA
  attention, causal fused kernel);
- ``ring K=2`` and ``ulysses K=2``: two gloo ranks, each holding half of the tokens
  (``gcore.backends.sequence_parallel``, packed row, zig-zag split).

Each rank uses one thread. Per rank it reports the step's peak resident memory above the rank's
resident memory just before the step (Linux VmHWM after resetting it through
``/proc/self/clear_refs``; the ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors
go back to the system and the high-water mark follows live tensors, not glibc's retained heap),
the step time (the fastest of ``--steps``), and the seconds spent inside
the sequence-parallel collectives (ring send/recv, all-to-all, the log-probability all-gather; this
includes waiting for the other rank). Ratios are against K=1 at the same length.

    python benchmarks/long_context.py --lengths 1024 2048 4096 8192 16384 32768
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = {"K=1": (1, None), "ring K=2": (2, "ring"), "ulysses K=2": (2, "ulysses")}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the resident high-water mark (VmHWM)
        f.write("5")


def _model(length: int):
    from gcore.model import ModelConfig, build_tiny_model, char_tokenizer

    config = ModelConfig(max_position_embeddings=max(length, 256))
    model = build_tiny_model(config, char_tokenizer(), seed=0).float()
    model.train()
    return model, model.config.vocab_size


class _CommTimer:
    """Wall seconds inside the sequence-parallel collectives (patched into the module for this process)."""

    def __init__(self) -> None:
        from gcore.backends import sequence_parallel as seqpar

        self.seconds = 0.0
        for name in ("_ring_exchange", "_all_to_all", "gather_replicated"):
            setattr(seqpar, name, self._timed(getattr(seqpar, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper


def _step(model, ids: torch.Tensor, sp, mode: str | None) -> None:
    from gcore.backends import sequence_parallel as seqpar
    from gcore.backends import token_logprobs

    mask = torch.ones_like(ids)
    if sp is None:
        logprobs, _ = token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids, 1.0)
    else:
        logprobs, _ = seqpar.sequence_parallel_logprobs(model, ids, mask, 1.0, sp, pack=True)
    logprobs.sum().backward()
    model.zero_grad(set_to_none=True)


def _measure(rank: int, length: int, size: int, mode: str | None, steps: int) -> dict[str, float]:
    from gcore.backends import sequence_parallel as seqpar

    torch.set_num_threads(1)
    model, vocab = _model(length)
    sp = None
    timer = None
    if size > 1:
        sp = seqpar.SequenceParallelGroup.create(size, mode)
        seqpar.use_sequence_parallel_attention(model)
        timer = _CommTimer()
    ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(length))
    times, comm = [], []
    before = _rss_kib("VmRSS")
    _reset_peak()
    for _ in range(steps):
        if sp is not None:
            dist.barrier(group=sp.group)
            timer.seconds = 0.0
        start = time.perf_counter()
        _step(model, ids, sp, mode)
        times.append(time.perf_counter() - start)
        comm.append(timer.seconds if timer else 0.0)
    peak = _rss_kib("VmHWM")
    best = min(range(steps), key=lambda i: times[i])
    return {"peak_mib": (peak - before) / 1024, "rss_mib": peak / 1024, "step_s": times[best], "comm_s": comm[best]}


def _worker(rank: int, world: int, port: int, length: int, mode: str | None, steps: int, out_dir: str) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(_measure(rank, length, world, mode, steps), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(length: int, config: str, steps: int) -> dict[str, float]:
    """One configuration in fresh processes; the per-rank maximum of memory and times."""
    size, mode = CONFIGS[config]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(size, _free_port(), length, mode, steps, out_dir), nprocs=size, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(size)]
    return {key: max(r[key] for r in ranks) for key in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration (the fastest is kept)")
    parser.add_argument("--long", type=int, default=16384, help="from this length on, one step only")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the rank processes
    print("| tokens | config | peak MiB / rank (step) | peak RSS MiB / rank | step s | comm s (share) "
          "| memory / K=1 | time / K=1 |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in args.lengths:
        steps = 1 if length >= args.long else args.steps
        base = None
        for config in args.configs:
            r = run(length, config, steps)
            if config == "K=1":
                base = r
            ratio_mem = f"{r['peak_mib'] / base['peak_mib']:.2f}" if base else "-"
            ratio_time = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
            share = r["comm_s"] / r["step_s"] if r["step_s"] else 0.0
            print(f"| {length} | {config} | {r['peak_mib']:.0f} | {r['rss_mib']:.0f} | {r['step_s']:.2f} "
                  f"| {r['comm_s']:.2f} ({share:.0%}) | {ratio_mem} | {ratio_time} |", flush=True)


if __name__ == "__main__":
    main()
