"""Seeded runs before and after a refactor: every metric but the clock's must be bit-equal.

Record the runs of one checkout, then of another, then compare them:

    python scripts/compare_runs.py record --code /tmp/base --out /tmp/runs-before
    python scripts/compare_runs.py record --code .         --out /tmp/runs-after
    python scripts/compare_runs.py compare /tmp/runs-before /tmp/runs-after

``record`` runs ``gcore fit`` with ``PYTHONPATH=<code>`` for each configuration in ``RUNS`` (the
default run, dynamic placement (as is, on one worker, and with a generative judge on two), two
controllers, one controller for two processes (GRPO and PPO), static placement over engine workers
with a generative judge, DAPO's dynamic sampling, PPO, a multi-turn environment, the rollouts in flight of
``--trainer.max_staleness`` 1 and 2 written into checkpoints and resumed from one) and keeps each run's
``metrics.csv``. ``compare``
prints, per run, the columns that differ; wall-clock columns (``time/*``, ``*_s``, ``*gb_per_s``,
memory high-water marks) are left out, since no two runs take the same time. Exit code 1 when a
compared column differs or a run is missing.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile

COMMON = ["--trainer.max_steps", "6", "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false",
          "--trainer.seed", "7"]
TWO = ["--trainer.devices", "2", "--trainer.accelerator", "cpu"]
JUDGE = "{judge}"  # replaced by a tiny judge checkpoint made for the recording
RUNS: dict[str, list[str]] = {
    "default": [],
    "dynamic": ["--placement", "dynamic"],  # the split follows measured times: not reproducible (see compare)
    "dynamic_one_worker": ["--placement", "dynamic", "--placement.workers", "1"],
    "dynamic_judge": ["--placement", "dynamic", "--placement.workers", "2", "--reward", "generative",
                      "--reward.path", JUDGE, "--reward.max_new_tokens", "4", "--data.prompts_per_step", "4",
                      "--sampling.n", "2", "--sampling.max_new_tokens", "4"],
    "two_controllers": TWO,
    "one_controller": [*TWO, "--trainer.controllers", "1"],
    "one_controller_ppo": [*TWO, "--trainer.controllers", "1", "--algorithm", "ppo"],
    "static_workers_judge": ["--placement.workers", "2", "--reward", "generative", "--reward.path", JUDGE,
                             "--reward.max_new_tokens", "4", "--data.prompts_per_step", "4", "--sampling.n", "2",
                             "--sampling.max_new_tokens", "4"],
    "dapo_dynamic_sampling": ["--config", "examples/dapo_dynamic_sampling.yaml", "--trainer.accelerator", "cpu"],
    "ppo": ["--algorithm", "ppo"],
    "static_workers": ["--placement.workers", "2"],
    "reveal": ["--data.task", "reveal", "--env", "reveal", "--sampling.max_new_tokens", "8"],
    "reveal_workers_async": ["--data.task", "reveal", "--env", "reveal", "--sampling.max_new_tokens", "8",
                             "--placement.workers", "2", "--trainer.max_staleness", "1"],
    # the rollouts in flight: written into checkpoints every 2 steps, and resumed from the one after step 1
    # (``RESUMED``), over static engine workers (dynamic placement's split follows measured times)
    "async_k1": ["--placement.workers", "1", "--trainer.max_staleness", "1", "--trainer.checkpoint_every", "2",
                 "--trainer.keep_checkpoints", "5"],
    "async_k2": ["--placement.workers", "2", "--trainer.max_staleness", "2", "--trainer.checkpoint_every", "2",
                 "--trainer.keep_checkpoints", "5"],
    "async_k1_step_dispatch": ["--placement.workers", "2", "--trainer.max_staleness", "1", "--trainer.dispatch",
                               "step"],
    "async_k1_dapo_oversample": ["--config", "examples/dapo_dynamic_sampling.yaml", "--trainer.accelerator", "cpu",
                                 "--placement.workers", "2", "--trainer.max_staleness", "1",
                                 "--trainer.oversample", "true", "--trainer.checkpoint_every", "2",
                                 "--trainer.keep_checkpoints", "5"],
}
#: runs resumed, once recorded, from the checkpoint written after step 1: ``<run>_resumed.csv`` is the metrics.csv
#: the resumed run continued (the steps it redid replaced), to compare as a run of its own
RESUMED = ("async_k1", "async_k2", "async_k1_dapo_oversample")


def clock_column(name: str) -> bool:
    """Columns measured by a clock, a memory high-water mark or the machine's load (the thread
    governor's ``threads/*``: what other processes used): never equal between two runs."""
    return (name.startswith(("time/", "memory/", "threads/")) or name.endswith(("_s", "gb_per_s"))
            or name.startswith("placement/idle_"))


def make_judge(folder: str, code: str) -> str:
    script = ("import sys; from gcore.model import ModelConfig, char_tokenizer, materialize; "
              "print(materialize(ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, "
              "num_key_value_heads=1, intermediate_size=64), char_tokenizer(), seed=1, workdir=sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": code}
    subprocess.run([sys.executable, "-c", script, folder], check=True, env=env, capture_output=True)
    return folder


def record(code: str, out: str, only: list[str]) -> int:
    code, out = os.path.abspath(code), os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    judge = make_judge(os.path.join(out, "judge"), code)
    env = {**os.environ, "PYTHONPATH": code}
    failed = 0
    for name, args in RUNS.items():
        if only and name not in only:
            continue
        args = [a.replace(JUDGE, judge) for a in args]
        root = tempfile.mkdtemp(prefix=f"gcore-compare-{name}-")
        config = args[:2] if args[:1] == ["--config"] else []  # first: the options after it override it
        cmd = [sys.executable, "-m", "gcore.cli", "fit", *config, *COMMON, "--trainer.default_root_dir", root,
               "--trainer.name", name, *args[len(config):]]
        print("+ PYTHONPATH=" + code, " ".join(cmd[1:]), flush=True)
        result = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
        csvs = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f == "metrics.csv"]
        if result.returncode != 0 or len(csvs) != 1:
            print(f"{name}: failed (exit {result.returncode})\n{result.stderr[-3000:]}", flush=True)
            failed += 1
            continue
        shutil.copy(csvs[0], os.path.join(out, f"{name}.csv"))
        print(f"{name}: recorded", flush=True)
        if name in RESUMED:
            checkpoint = os.path.join(root, name, "checkpoints", "step_00000001")
            result = subprocess.run([*cmd, "--trainer.resume", checkpoint], env=env, cwd=code, capture_output=True,
                                    text=True)
            if result.returncode != 0:
                print(f"{name}_resumed: failed (exit {result.returncode})\n{result.stderr[-3000:]}", flush=True)
                failed += 1
                continue
            shutil.copy(csvs[0], os.path.join(out, f"{name}_resumed.csv"))
            print(f"{name}_resumed: recorded", flush=True)
    return 1 if failed else 0


def read(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def compare(before: str, after: str, only: list[str]) -> int:
    bad = 0
    for name in [n for run in only or RUNS for n in ((run, f"{run}_resumed") if run in RESUMED else (run,))]:
        a_path, b_path = os.path.join(before, f"{name}.csv"), os.path.join(after, f"{name}.csv")
        if not (os.path.exists(a_path) and os.path.exists(b_path)):
            print(f"{name}: missing in {'before' if not os.path.exists(a_path) else 'after'}")
            bad += 1
            continue
        a, b = read(a_path), read(b_path)
        columns = sorted(set(a[0]) | set(b[0]))
        compared = [c for c in columns if not clock_column(c)]
        differ = [c for c in compared
                  if len(a) != len(b) or any(x.get(c) != y.get(c) for x, y in zip(a, b, strict=False))]
        if differ:
            bad += 1
            print(f"{name}: {len(differ)} of {len(compared)} columns differ: {', '.join(differ)}")
        else:
            print(f"{name}: {len(a)} rows, {len(compared)} columns bit-equal "
                  f"({len(columns) - len(compared)} clock columns left out)")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run every configuration and keep its metrics.csv")
    rec.add_argument("--code", required=True, help="the checkout to run (put first on PYTHONPATH)")
    rec.add_argument("--out", required=True, help="folder for <run>.csv")
    rec.add_argument("--only", nargs="*", default=[], choices=list(RUNS), help="run only these")
    cmp_ = sub.add_parser("compare", help="compare two recorded folders")
    cmp_.add_argument("before")
    cmp_.add_argument("after")
    cmp_.add_argument("--only", nargs="*", default=[], choices=list(RUNS), help="compare only these")
    args = parser.parse_args()
    if args.command == "record":
        return record(args.code, args.out, args.only)
    return compare(args.before, args.after, args.only)


if __name__ == "__main__":
    sys.exit(main())
