"""Dynamic placement against every static split, on a workload whose balance shifts during the run.

    gcore import $GGUF /tmp/smollm2-hf          # SmolLM2-135M-Instruct (docs/real_models.md)
    python benchmarks/placement_shift.py --policy /tmp/smollm2-hf --judge /tmp/smollm2-hf --steps 8 --rounds 1
    python benchmarks/placement_shift.py --policy /tmp/smollm2-hf --judge /tmp/smollm2-hf -- --trainer.max_staleness 1
    python benchmarks/placement_shift.py --policy /tmp/smollm2-hf --judge /tmp/smollm2-hf --device_quota 0.33

The workload: the ``mixed`` task (``--data.task mixed``, not shuffled), whose prompts are compare
questions scored by the ``math`` rule and open-ended prompts scored by a generative judge
(``--reward routed``), with the judged share rising from ``--share`` start to end over the run. Early
steps are nearly all generation; late steps are dominated by the judge. Every run uses one pool of
``--workers`` engine workers shared by ``--controllers`` controllers (``--placement dynamic``); a
*static* split is the same placement with the split fixed (``--placement.hysteresis 1e9``: it never
moves), so the runs differ only in whether the split follows the work.

Runs are alternated ``--rounds`` times in one invocation (dynamic, then each static split, then again),
with the same seed, prompts and sampling. Printed per placement: samples/s over the steps after
``--warmup`` (samples / the sum of their step times, and / the sum of their rollout phases: training
takes the same time under every placement), the rollout phase's share of the step, each
role's idle share of its device-seconds in the rollout phase, and the split at each step; then the
ratios dynamic / best static and dynamic / worst static. Each run's folder is kept under ``--out``
(metrics.csv; ``gcore report`` plots ``placement/*``). Record the output in BENCHMARKS.md with the
date, the machine, the load and the command.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

JUDGE_TEMPLATE = "Task: {prompt}\nResponse: {response}\nDoes the response do the task? Answer yes or no."


def routed_reward(judge: str, template: str = JUDGE_TEMPLATE) -> str:
    judge_reward = {"class_path": "gcore.rewards.generative.GenerativeReward",
                    "init_args": {"path": judge, "template": template, "batch_size": 64}}
    return json.dumps({"class_path": "gcore.rewards.routed.RoutedReward", "init_args": {"routes": {
        "math": {"class_path": "gcore.rewards.math.MathReward"}, "judge": judge_reward}}})


class DeviceQuota:
    """Holds every process of a run (each controller and each engine worker) to ``cpus`` CPUs of its own with a
    cgroup-v1 CPU quota, so that each behaves as a device of fixed speed: an idle worker's share is lost, as an
    idle GPU's is, instead of going to the busy processes (on a shared CPU a wrong split otherwise costs only
    scheduling). Needs root and the cgroup-v1 ``cpu`` controller at /sys/fs/cgroup/cpu."""

    ROOT = Path("/sys/fs/cgroup/cpu")

    def __init__(self, cpus: float) -> None:
        self.cpus, self.groups, self.placed = cpus, [], 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> DeviceQuota:
        if not (self.ROOT / "cgroup.procs").exists():
            raise SystemExit(f"--device_quota needs the cgroup-v1 cpu controller at {self.ROOT}")
        return self

    def watch(self, pid: int) -> None:
        """Place ``pid`` and each process it starts (now and later) in a cgroup of its own."""
        import psutil

        def loop() -> None:
            seen: set[int] = set()
            while not self.stop.is_set():
                try:
                    root = psutil.Process(pid)
                    family = [root, *root.children(recursive=True)]
                except psutil.NoSuchProcess:
                    return
                for process in family:
                    if process.pid in seen or "resource_tracker" in " ".join(process.cmdline() or []):
                        continue
                    seen.add(process.pid)
                    group = self.ROOT / f"gcore-device-{pid}-{process.pid}"
                    group.mkdir(exist_ok=True)
                    (group / "cpu.cfs_period_us").write_text("100000")
                    (group / "cpu.cfs_quota_us").write_text(str(int(self.cpus * 100000)))
                    try:
                        (group / "cgroup.procs").write_text(str(process.pid))
                        self.placed += 1
                    except OSError:  # it ended meanwhile
                        pass
                    self.groups.append(group)
                self.stop.wait(0.2)

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        for group in self.groups:
            for _ in range(50):  # the last processes may take a moment to leave
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def fit(name: str, placement: list[str], args: argparse.Namespace, out: Path) -> list[dict[str, float]]:
    """One ``gcore fit`` run; its metrics.csv rows."""
    root = out / name
    command = [sys.executable, "-m", "gcore", "fit", "--model.path", args.policy, "--trainer.accelerator", "cpu",
               "--trainer.devices", str(args.controllers), "--trainer.max_steps", str(args.steps),
               "--trainer.seed", str(args.seed), "--trainer.default_root_dir", str(root),
               "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false",
               "--data.task", "mixed", "--data.task_judged_share", json.dumps(args.share),
               "--data.shuffle", "false", "--data.chat_template", "true" if args.chat_template else "false",
               "--data.num_synthetic_prompts", str(args.steps * args.prompts),
               "--data.prompts_per_step", str(args.prompts), "--sampling.n", str(args.n),
               "--sampling.max_new_tokens", str(args.max_new_tokens), "--reward", routed_reward(args.judge),
               "--placement", "dynamic", "--placement.workers", str(args.workers),
               "--placement.min_fraction", str(1 / args.workers), *placement, *args.fit_args]
    started = time.perf_counter()
    if args.device_quota:
        with DeviceQuota(args.device_quota) as quota:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            quota.watch(process.pid)
            stdout, stderr = process.communicate()
        done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
        print(f"  {name}: {quota.placed} processes held to {args.device_quota:g} CPU each", flush=True)
    else:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
    metrics = next(root.rglob("metrics.csv"))
    return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(metrics.open())]


def summary(rows: list[dict[str, float]], warmup: int, workers: int, first_judges: int) -> dict[str, float]:
    # a row logs the split decided after its step; the step ran on the one before
    used = [first_judges] + [int(r["placement/judge_devices"]) for r in rows[:-1]]
    steady = list(zip(rows, used, strict=True))[warmup:]
    step_s = sum(r["time/step"] for r, _ in steady)
    rollout = sum(r["time/rollout"] for r, _ in steady)
    generate_s = sum(r["time/rollout"] * (workers - j) for r, j in steady)  # device-seconds held by each role
    judge_s = sum(r["time/rollout"] * j for r, j in steady)
    idle_generate = sum(r["placement/idle_generate_s"] * (workers - j) for r, j in steady)
    idle_judge = sum(r["placement/idle_judge_s"] * j for r, j in steady)
    steady_rows = [r for r, _ in steady]
    samples = sum(r["samples/total"] for r in steady_rows)
    return {"samples_per_s": samples / step_s, "rollout_samples_per_s": samples / rollout,
            "rollout_share": rollout / step_s,
            "idle_generate": idle_generate / max(generate_s, 1e-9), "idle_judge": idle_judge / max(judge_s, 1e-9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", required=True, help="the policy's HF checkpoint folder")
    parser.add_argument("--judge", required=True, help="the judge's HF checkpoint folder")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--controllers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (all controllers)")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--share", type=float, nargs=2, default=[0.0, 1.0], help="judged share, first and last")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat_template", type=int, default=1, help="1: prompts in the policy's chat template")
    parser.add_argument("--out", default="/tmp/gcore-placement-shift")
    parser.add_argument("--device_quota", type=float, default=0.0,
                        help="hold each controller and each worker to this many CPUs of its own (a cgroup CPU quota): "
                             "processes that behave as devices (0: off, they share the cores)")
    parser.add_argument("fit_args", nargs="*", help="after --: options passed on to every gcore fit run")
    args = parser.parse_args()
    out = Path(args.out)
    firsts = {f"static {args.workers - j}/{j}": j for j in range(1, args.workers)}
    splits = {name: ["--placement.judge_fraction", str(j / args.workers), "--placement.hysteresis", "1e9"]
              for name, j in firsts.items()}
    configs = {"dynamic": ["--placement.judge_fraction", str(1 / args.workers)], **splits}
    firsts["dynamic"] = 1
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"{args.controllers} controllers, {args.workers} workers, {args.steps} steps, share {args.share}; "
          f"gcore fit {' '.join(args.fit_args)}")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    splits_seen: dict[str, list[int]] = {}
    for round_ in range(args.rounds):
        for name, placement in configs.items():
            rows = fit(f"r{round_}-{name.replace(' ', '_').replace('/', '-')}", placement, args, out)
            results[name].append(summary(rows, args.warmup, args.workers, firsts[name]))
            splits_seen[name] = [int(r["placement/judge_devices"]) for r in rows]
    print(f"\n{'placement':<14}{'samples/s':>10}{'in rollout':>11}{'rollout':>9}{'idle gen':>10}{'idle judge':>11}  "
          "judge workers after each step")
    medians = {}
    for name, runs in results.items():
        med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        medians[name] = med
        print(f"{name:<14}{med['samples_per_s']:>10.3f}{med['rollout_samples_per_s']:>11.3f}{med['rollout_share']:>9.0%}{med['idle_generate']:>10.0%}"
              f"{med['idle_judge']:>11.0%}  {splits_seen[name]}")
    statics = [medians[name]["samples_per_s"] for name in splits]
    dynamic = medians["dynamic"]["samples_per_s"]
    print(f"\ndynamic / best static: {dynamic / max(statics):.3f}   "
          f"dynamic / worst static: {dynamic / min(statics):.3f}   (samples/s of whole steps)")
    statics = [medians[name]["rollout_samples_per_s"] for name in splits]
    dynamic = medians["dynamic"]["rollout_samples_per_s"]
    print(f"dynamic / best static: {dynamic / max(statics):.3f}   "
          f"dynamic / worst static: {dynamic / min(statics):.3f}   (samples/s of the rollout phase)")
    print(f"load average after: {os.getloadavg()[0]:.1f}; runs under {out}")


if __name__ == "__main__":
    main()
