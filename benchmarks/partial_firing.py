"""Whether partial rollouts fire (``async/partial_samples`` > 0) in each run shape, on a long-tail workload (issue 47).

    python benchmarks/partial_firing.py --steps 8 --out benchmarks/results/raw/partial-firing-DATE.csv
    python benchmarks/partial_firing.py --shapes static1 -- --sampling.max_new_tokens 224   # another workload
    python benchmarks/partial_firing.py --rollout multiturn --shapes static1 dynamic   # two-turn episodes
    python benchmarks/partial_firing.py --rollout judge --shapes static1 dynamic        # a generative judge

Runs ``gcore fit`` (this checkout first on ``PYTHONPATH``) with ``--trainer.max_staleness 1
--trainer.partial_rollouts true`` once per shape: ``static1`` (``--placement.workers 1``), ``static2`` (two
workers), ``dynamic`` (``--placement dynamic --placement.workers 2``) and ``checkpoint`` (``static1`` with
``--trainer.checkpoint_every 3``), and writes one CSV row per shape and step (``--out``) with the samples a weight
update cut, the trained samples, the token staleness, the behaviour importance ratio's deviation from 1 (the
correction at work), the training and step times and the reply lengths; a summary line per shape goes to stdout.

The default workload has a long tail of reply lengths: the embedded tiny model (1 layer, hidden 32) with a
1024-token context and a 960-token budget, 4 prompts x 4 samples a step. A random tiny model ends a reply with
its end-of-sequence token at a roughly constant rate per token, so its reply lengths are geometric: a mean near
100 tokens and, in a batch of 16, a longest reply of 300-900. The step's generation lasts as long as its longest
reply, while training a step of 16 samples takes a fraction of that: the rollout in flight is still generating when
the weight update comes. Everything after ``--`` is passed on to ``gcore fit`` (after the defaults: it wins).

``--rollout`` picks what a rollout is: ``single`` (one generation per sample, the default), ``multiturn`` (the
embedded ``--env reveal`` task's two-turn episodes, 480 new tokens a turn so that both fit the 1024-token context)
or ``judge`` (one generation per sample judged by a generative judge: a random tiny model of the policy's shape,
``--reward.verdict probability``; it shows the plumbing, not judging). Those two run in a thread of the controller
(docs/asynchronous.md, "When a cut fires, and where it cannot").
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from functools import cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the long-tail workload (see the module's docstring)
WORKLOAD = ["--model.num_hidden_layers", "1", "--model.hidden_size", "32", "--model.intermediate_size", "64",
            "--model.max_position_embeddings", "1024", "--sampling.max_new_tokens", "960",
            "--data.prompts_per_step", "4", "--sampling.n", "4"]
SHAPES = {"static1": ["--placement.workers", "1"],
          "static2": ["--placement.workers", "2"],
          "dynamic": ["--placement", "dynamic", "--placement.workers", "2"],
          "checkpoint": ["--placement.workers", "1", "--trainer.checkpoint_every", "3"]}
#: what a rollout is (``--rollout``): the options it adds (``judge``'s checkpoint is made by ``tiny_judge``)
ROLLOUTS = {"single": [],
            "multiturn": ["--env", "reveal", "--data.task", "reveal", "--sampling.max_new_tokens", "480"],
            "judge": ["--reward", "generative", "--reward.verdict", "probability"]}
COLUMNS = ["async/partial_samples", "samples/trained", "async/token_staleness_mean", "async/staleness_max",
           "async/behaviour_ratio_dev", "async/rollout_wait_s", "time/train", "time/step", "response_length/mean",
           "response_length/max"]


@cache
def tiny_judge() -> str:
    """A random tiny model of the workload's shape (seed 1) written as a checkpoint the judge loads."""
    sys.path.insert(0, ROOT)
    from gcore.model import ModelConfig, char_tokenizer, materialize

    config = ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, max_position_embeddings=2048)
    return materialize(config, char_tokenizer(), 1, tempfile.mkdtemp(prefix="gcore-judge-"))


def rollout_options(rollout: str) -> list[str]:
    return ROLLOUTS[rollout] + (["--reward.path", tiny_judge()] if rollout == "judge" else [])


def run(shape: str, steps: int, seed: int, extra: list[str]) -> list[dict[str, str]]:
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", folder, "--trainer.logger", "csv",
               "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false", "--trainer.seed", str(seed),
               "--trainer.max_steps", str(steps), "--trainer.max_staleness", "1", "--trainer.partial_rollouts", "true",
               *WORKLOAD, *SHAPES[shape], *extra]
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
        if done.returncode:
            sys.exit(f"{shape}: gcore fit failed:\n{done.stderr[-3000:]}")
        path = next(os.path.join(d, "metrics.csv") for d, _, files in os.walk(folder) if "metrics.csv" in files)
        with open(path) as f:
            return [r for r in csv.DictReader(f) if r.get("reward/mean")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", help="the per-step CSV (default: stdout only)")
    parser.add_argument("--rollout", default="single", choices=list(ROLLOUTS),
                        help="one generation per sample, two-turn episodes, or a generative judge")
    parser.add_argument("extra", nargs="*", help="after --: options for gcore fit")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        started = time.perf_counter()
        steps = run(shape, args.steps, args.seed, rollout_options(args.rollout) + args.extra)
        cut = [float(r["async/partial_samples"]) for r in steps]
        print(f"{shape} ({args.rollout}): load {load}, {time.perf_counter() - started:.0f} s; partial_samples per step "
              f"{[int(c) for c in cut]} of {[int(float(r['samples/trained'])) for r in steps]}; "
              f"steps that cut {sum(c > 0 for c in cut[1:])} of {len(cut) - 1} (step 0 generates synchronously)",
              flush=True)
        rows += [{"shape": shape, "load": load, "step": r["step"], **{k: r.get(k, "") for k in COLUMNS}} for r in steps]
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["shape", "load", "step", *COLUMNS])
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
