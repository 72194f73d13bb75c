"""The engine-worker pool on Ray against the local pool on one machine (issue 46): step time and weight-sync speed.

    python benchmarks/ray_pool.py --rounds 3 --steps 5 --out benchmarks/results/raw/ray-pool-DATE
    python benchmarks/ray_pool.py --sync-only --sync-hidden 512 --sync-layers 8

Starts a Ray cluster of ``--nodes`` nodes on this machine (``ray.cluster_utils.Cluster``: a head and worker nodes,
each its own raylet with ``--node-cpus`` logical CPUs; Ray's documented way of testing multi-node), then:

1. **Step time.** ``gcore fit --placement dynamic --placement.workers W --trainer.devices 2`` with the local pool
   and with ``--placement.cluster ray`` (same seed, same workload), alternating which goes first in each round, and
   reads ``time/step`` and ``time/sync`` of every step but the first (warm-up) from metrics.csv. Prints the median
   per pool and the ratio ray / local, per round and over all rounds. One CSV row per pool, round and step
   (``steps.csv``), with the load average before the run.
2. **Weight sync.** A ``WorkerPool`` of 2 policy workers (local: ``/dev/shm``; ray: the object store) holding a
   model of ``--sync-hidden`` x ``--sync-layers`` (float32) takes ``--syncs`` weight syncs; prints seconds per GB
   (the owner's put/copy and the workers' load) for both (``sync.csv``).

Everything after ``--`` goes to ``gcore fit`` (after the defaults: it wins).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = ["--data.prompts_per_step", "8", "--sampling.n", "4", "--sampling.max_new_tokens", "32"]


def fit(pool: str, address: str, workers: int, steps: int, seed: int, extra: list[str]) -> list[dict[str, str]]:
    with tempfile.TemporaryDirectory() as folder:
        cluster = ["--placement.cluster", "ray", "--placement.address", address] if pool == "ray" else []
        cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", folder, "--trainer.logger", "csv",
               "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false", "--trainer.seed", str(seed),
               "--trainer.max_steps", str(steps), "--trainer.devices", "2", "--trainer.accelerator", "cpu",
               "--placement", "dynamic", "--placement.workers", str(workers), *cluster, *WORKLOAD, *extra]
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
        if done.returncode:
            sys.exit(f"{pool}: gcore fit failed:\n{done.stderr[-3000:]}")
        path = next(os.path.join(d, "metrics.csv") for d, _, files in os.walk(folder) if "metrics.csv" in files)
        with open(path) as f:
            return [r for r in csv.DictReader(f) if r.get("time/step")]


def step_times(args: argparse.Namespace, address: str, out: str) -> None:
    rows, medians = [], {"local": [], "ray": []}
    for r in range(args.rounds):
        order = ["local", "ray"] if r % 2 == 0 else ["ray", "local"]
        for pool in order:
            load = os.getloadavg()[0]
            got = fit(pool, address, args.workers, args.steps, args.seed, args.fit_args)
            times = [float(g["time/step"]) for g in got[1:]]
            medians[pool].append(statistics.median(times))
            for g in got:
                rows.append({"round": r, "pool": pool, "step": g["step"], "load1": f"{load:.2f}",
                             "time/step": g["time/step"], "time/sync": g.get("time/sync", ""),
                             "sync/gb": g.get("sync/gb", ""),
                             "placement/judge_devices": g.get("placement/judge_devices", "")})
            print(f"round {r} {pool:5s}: median step {medians[pool][-1]:.2f}s over steps 2-{args.steps} "
                  f"(load {load:.1f})", flush=True)
        print(f"round {r}: ray / local = {medians['ray'][-1] / medians['local'][-1]:.3f}", flush=True)
    with open(os.path.join(out, "steps.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    local, ray = statistics.median(medians["local"]), statistics.median(medians["ray"])
    print(f"step time, median of round medians: local {local:.2f}s, ray {ray:.2f}s, ray / local = {ray / local:.3f}")


def sync_speed(args: argparse.Namespace, address: str, out: str) -> None:
    import torch

    from gcore.engines.hf import HFEngine
    from gcore.engines.pool import POLICY, RoleSpec, WorkerPool
    from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize

    with tempfile.TemporaryDirectory() as folder:
        config = ModelConfig(hidden_size=args.sync_hidden, num_hidden_layers=args.sync_layers, num_attention_heads=8,
                             num_key_value_heads=8, intermediate_size=4 * args.sync_hidden)
        path = materialize(config, char_tokenizer(), seed=0, workdir=os.path.join(folder, "model"))
        specs = {POLICY: RoleSpec(HFEngine(), ModelSource(path))}
        engine = HFEngine()
        engine.setup(ModelSource(path), torch.device("cpu"))
        named = [(name, t.detach().clone()) for name, t in engine.model.state_dict().items()]
        rows = []
        for pool_kind in ("local", "ray"):
            pool = WorkerPool(2, specs, [POLICY, POLICY], threads=1, ray_address=address if pool_kind == "ray" else "")
            try:
                for k in range(args.syncs):
                    for _, t in named:
                        t.add_(1e-4)
                    sync = pool.sync_weights(named)
                    gb = sync["shm_bytes"] / 1e9
                    rows.append({"pool": pool_kind, "sync": k, "gb": f"{gb:.4f}",
                                 "put_or_copy_s": f"{sync['copy_s']:.4f}", "load_s": f"{sync['load_s']:.4f}",
                                 "s": f"{sync['s']:.4f}",
                                 "load1": f"{os.getloadavg()[0]:.2f}"})
            finally:
                pool.close()
        with open(os.path.join(out, "sync.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        for pool_kind in ("local", "ray"):
            mine = [r for r in rows if r["pool"] == pool_kind][1:]  # the first sync creates the file / actors' refs
            per_gb = statistics.median(float(r["s"]) / float(r["gb"]) for r in mine)
            print(f"weight sync {pool_kind:5s}: {float(mine[0]['gb']):.3f} GB to 2 workers, median {per_gb:.2f} s/GB "
                  f"(put/copy {statistics.median(float(r['put_or_copy_s']) for r in mine):.3f}s, "
                  f"load {statistics.median(float(r['load_s']) for r in mine):.3f}s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--node-cpus", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--sync-hidden", type=int, default=512)
    parser.add_argument("--sync-layers", type=int, default=8)
    parser.add_argument("--sync-only", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "raw",
                                                     f"ray-pool-{time.strftime('%Y-%m-%d')}"))
    parser.add_argument("fit_args", nargs="*")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from ray.cluster_utils import Cluster

    store = {"num_cpus": args.node_cpus, "object_store_memory": 1 << 30}
    cluster = Cluster(initialize_head=True, head_node_args={**store, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(**store)
    cluster.wait_for_nodes()
    print(f"Ray cluster of {args.nodes} nodes x {args.node_cpus} CPUs at {cluster.address}; "
          f"{os.cpu_count()} cores here", flush=True)
    try:
        if not args.sync_only:
            step_times(args, cluster.address, args.out)
        sync_speed(args, cluster.address, args.out)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
