"""Where gcore's step time goes next to other work: wall-clock vs CPU seconds per stage, per thread setting.

Runs gcore's default tiny workload (the one ``benchmarks/vs_trl.py`` uses: 16 prompts x 8 generations, 16 new
tokens, the embedded model, one in-process controller) in a fresh process per run, under each thread setting
(``--configs``) and next to each neighbour kind (``--neighbour``, the kinds of ``vs_trl.py``), alternating
setting and neighbour so that load from other work on the machine hits them alike. Per stage it reports the
median wall-clock seconds and this process's CPU seconds (every thread, from ``time.process_time``): CPU seconds
well above wall seconds x useful threads are threads spinning, not working.

Settings: ``gcore`` (gcore's thread defaults: ``gcore/threads.py``, the adaptive thread count included),
``T1``/``T2`` (``OMP_NUM_THREADS`` 1/2), ``fixed`` (``OMP_NUM_THREADS`` = the usable cores: a fixed count, no
adaptive one), ``active``/``passive`` (``OMP_WAIT_POLICY``), ``spin0``/``spin1k``/``spin10k``/``spin30k``/``spin300k``
(``GOMP_SPINCOUNT`` 0/1000/10000/30000/300000), joined with ``+`` (``fixed+passive``); ``none``: libgomp's own
spin-then-sleep wait (``GOMP_SPINCOUNT=300000``, its default spin count, which a user's setting of it keeps) and
one torch thread per usable core, fixed: what gcore ran with before it chose its own defaults. Per run it prints the
torch threads in effect after each step (the adaptive count changes them).

    python benchmarks/threads.py --configs none,T1,T2+passive --neighbour none,pinned --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_trl import NEIGHBOURS, start_neighbour, stop_neighbour

STAGES = ("generate", "reward", "prepare", "train", "sync")
SETTINGS = {"T1": {"OMP_NUM_THREADS": "1"}, "T2": {"OMP_NUM_THREADS": "2"},
            "active": {"OMP_WAIT_POLICY": "active"}, "passive": {"OMP_WAIT_POLICY": "passive"},
            "spin0": {"GOMP_SPINCOUNT": "0"}, "spin1k": {"GOMP_SPINCOUNT": "1000"},
            "spin10k": {"GOMP_SPINCOUNT": "10000"}, "spin30k": {"GOMP_SPINCOUNT": "30000"},
            "spin300k": {"GOMP_SPINCOUNT": "300000"},
            "fixed": {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))},
            "none": {"GOMP_SPINCOUNT": "300000", "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}, "gcore": {}}


def worker(steps: int) -> dict:
    """One gcore run; per step, each stage's wall and CPU seconds."""
    import gcore.rollout as rollout
    from gcore import GRPO, Trainer, TrainerConfig

    cpu: dict[str, float] = {}
    timer_call = rollout.StageTimer.__call__.__wrapped__  # the generator behind the context manager

    def call(self, stage):
        start = time.process_time()
        yield from timer_call(self, stage)
        cpu[stage] = cpu.get(stage, 0.0) + time.process_time() - start

    rollout.StageTimer.__call__ = contextlib.contextmanager(call)
    import torch

    rows: list[dict] = []
    from gcore.controller import Controller

    step = Controller.step

    def timed_step(self, *a, **kw):
        cpu.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        out = step(self, *a, **kw)
        rows.append({"wall": {**{s: out.get(f"time/{s}", 0.0) for s in STAGES},
                              "step": time.perf_counter() - t0}, "threads": torch.get_num_threads(),
                     "cpu": {**{s: cpu.get(s, 0.0) for s in STAGES}, "step": time.process_time() - c0}})
        return out

    Controller.step = timed_step
    with tempfile.TemporaryDirectory(prefix="gcore-threads-") as root:
        Trainer(trainer=TrainerConfig(max_steps=steps, seed=42, accelerator="cpu", default_root_dir=root,
                                      enable_progress_bar=False, save_final=False),
                algorithm=GRPO(clip_eps=0.2, kl_coef=0.0, loss_agg="seq_mean_token_mean")).fit()
    with open("/proc/self/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return {"rows": rows, "torch_threads": torch.get_num_threads(), "os_threads": threads,
            "wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="none,gcore,T1,T2+passive")
    parser.add_argument("--neighbour", default="none,pinned")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write every run's raw figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("THREADS-RESULT " + json.dumps(worker(args.steps)), flush=True)
        return
    configs = [c for c in args.configs.split(",") if c]
    kinds = [k for k in args.neighbour.split(",") if k]
    for c in configs:
        for part in c.split("+"):
            if part not in SETTINGS:
                parser.error(f"--configs: unknown {part!r}; valid: {', '.join(SETTINGS)}")
    if set(kinds) - set(NEIGHBOURS):
        parser.error(f"--neighbour: valid kinds are {', '.join(NEIGHBOURS)}")
    results: dict[tuple[str, str], list[dict]] = {(c, k): [] for c in configs for k in kinds}
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for repeat in range(args.repeats):
        for kind in kinds:
            for config in configs:
                env = dict(base)
                for part in config.split("+"):
                    env.update(SETTINGS[part])
                neighbour = start_neighbour(kind)
                try:
                    proc = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(args.steps)],
                                          capture_output=True, text=True, env=env)
                finally:
                    stop_neighbour(neighbour)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("THREADS-RESULT ")]
                if proc.returncode or not lines:
                    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                    raise SystemExit(f"{config} next to {kind} failed")
                run = json.loads(lines[-1].split(" ", 1)[1])
                with open("/proc/loadavg") as f:
                    run["load"] = f.read().split()[0]
                results[(config, kind)].append(run)
                med = statistics.median(r["wall"]["step"] for r in run["rows"][args.warmup:])
                used = "".join(str(r["threads"]) for r in run["rows"])
                print(f"[{repeat + 1}/{args.repeats}] {kind:8s} {config:12s} step {med:.3f} s, torch threads "
                      f"per step {used}, OS threads {run['os_threads']}, load {run['load']}", flush=True)
    print("\nmedian seconds per step after warm-up, wall / CPU (this process, all threads); load: 1-min average "
          "after each run")
    print(f"{'neighbour':9s} {'setting':12s} " + " ".join(f"{s:>13s}" for s in (*STAGES, "step")) + "  load")
    for (config, kind), runs in results.items():
        rows = [r for run in runs for r in run["rows"][args.warmup:]]
        cells = []
        for s in (*STAGES, "step"):
            cells.append(f"{statistics.median(r['wall'][s] for r in rows):6.3f}/"
                         f"{statistics.median(r['cpu'][s] for r in rows):6.3f}")
        print(f"{kind:9s} {config:12s} " + " ".join(f"{c:>13s}" for c in cells) + "  "
              + ",".join(r["load"] for r in runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{c}|{k}": v for (c, k), v in results.items()}, f)


if __name__ == "__main__":
    main()
