"""Does a real model learn to use a tool? Held-out accuracy before and after GRPO, with and without the tool.

    gcore import $GGUF /tmp/smollm2-hf          # SmolLM2-135M-Instruct (docs/real_models.md)
    python benchmarks/tool_learning.py --model /tmp/smollm2-hf --seeds 0 1 --steps 20

Each run is ``examples/real_model/grpo_smollm2_calculator.yaml`` (GRPO on 1-2 digit word problems, the
``math`` reward, held-out evaluation on 128 test-split problems before the first step and after the last,
greedy and sampled) in one of two settings:

- ``tool``: the calculator tool and four worked examples that call it (``calculator_examples.jsonl``);
- ``direct``: no tool, one turn, the same four examples answered directly (``direct_examples.jsonl``): what
  the same model learns from the same reward without the tool.

Beside them, two baselines that need no model: ``format only`` answers every held-out question in the right
format with its first number (what knowing the format alone scores), and ``calculator oracle`` with the right
expression (the ceiling for a policy that always calls the tool right). Printed per run: accuracy before and
after, the train reward and tool calls per episode at the first and last steps. ``--parallel`` runs all the runs
at once (on a GPU); other options go to ``gcore fit``. Record the output in BENCHMARKS.md with the date, the
machine and the load.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gcore.envs.base import Turn
from gcore.envs.tool_env import ToolEnvironment
from gcore.types import Prompt

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "real_model" / "grpo_smollm2_calculator.yaml"


class DirectAnswers(ToolEnvironment):
    """The control: no tool described, the examples answered directly, one turn (the answer)."""

    def __init__(self, examples: str = str(ROOT / "examples" / "real_model" / "direct_examples.jsonl")) -> None:
        super().__init__(tools=["calculator"], examples=examples, max_turns=1)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        question = {"role": "user", "content": prompt.content if prompt.content is not None else prompt.text}
        text = self._apply([*self._example_messages, question], add_generation_prompt=True)
        return list(self._tokenizer().encode(text, add_special_tokens=False))

    def step(self, state: dict[str, Any], response: str) -> Turn:
        return Turn(done=True)


SETTINGS = {"tool": [], "direct": ["--env", "tool_learning.DirectAnswers"]}


def command(setting: str, seed: int, args: argparse.Namespace, root: Path) -> list[str]:
    return [sys.executable, "-m", "gcore", "fit", "--config", str(CONFIG), "--model.path", args.model,
            "--trainer.max_steps", str(args.steps), "--trainer.eval_every", str(args.steps),
            "--trainer.seed", str(seed), "--trainer.default_root_dir", str(root), "--trainer.accelerator",
            args.accelerator, "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false",
            *SETTINGS[setting], *args.fit_args]


def summary(root: Path) -> dict[str, float]:
    rows = list(csv.DictReader(next(root.rglob("metrics.csv")).open()))
    evals = [r for r in rows if r.get("eval/accuracy_greedy")]
    steps = [r for r in rows if r.get("reward/mean")]

    def mean(rows: list[dict[str, str]], key: str, per: str | None = None) -> float:
        values = [float(r[key]) / (float(r[per]) if per else 1.0) for r in rows if r.get(key)]
        return sum(values) / len(values) if values else float("nan")

    first, last = steps[:3], steps[-3:]
    return {"greedy_before": float(evals[0]["eval/accuracy_greedy"]),
            "sampled_before": float(evals[0]["eval/accuracy_sampled"]),
            "greedy_after": float(evals[-1]["eval/accuracy_greedy"]),
            "sampled_after": float(evals[-1]["eval/accuracy_sampled"]),
            "reward_first": mean(first, "reward/mean"), "reward_last": mean(last, "reward/mean"),
            "calls_first": mean(first, "env/tool_calls", "env/episodes"),
            "calls_last": mean(last, "env/tool_calls", "env/episodes")}


def baselines() -> dict[str, float]:
    """Accuracy of answering each held-out problem with its first number, and with the right result."""
    from gcore.tasks import arithmetic_rows

    rows = arithmetic_rows(128, split="test", digits=(1, 2))
    first = [re.findall(r"\d+", row["prompt"])[0] == row["answer"] for row in rows]
    return {"format only": sum(first) / len(rows), "calculator oracle": 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--parallel", action="store_true", help="start every run at once (a GPU)")
    parser.add_argument("--out", default="/tmp/gcore-tool-learning")
    args, args.fit_args = parser.parse_known_args()  # the rest go to gcore fit (e.g. --data.num_eval_prompts 8)
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {args.steps} steps, seeds {args.seeds}, "
          f"{args.accelerator}", flush=True)
    for name, value in baselines().items():
        print(f"  {name:<18} held-out accuracy {value:.3f}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    runs = [(setting, seed) for seed in args.seeds for setting in SETTINGS]
    started = time.perf_counter()
    procs: dict[tuple[str, int], subprocess.Popen[str]] = {}
    for setting, seed in runs:
        root = Path(args.out) / f"{setting}-{seed}"
        procs[setting, seed] = subprocess.Popen(command(setting, seed, args, root), cwd=ROOT, env=env, text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if not args.parallel:
            procs[setting, seed].wait()
    for (setting, seed), proc in procs.items():
        output, _ = proc.communicate()
        if proc.returncode != 0:
            print(f"  {setting} seed {seed} failed:\n{output[-3000:]}", flush=True)
            continue
        r = summary(Path(args.out) / f"{setting}-{seed}")
        print(f"  {setting:<6} seed {seed}: held-out greedy {r['greedy_before']:.3f} -> {r['greedy_after']:.3f}, "
              f"sampled {r['sampled_before']:.3f} -> {r['sampled_after']:.3f}; train reward "
              f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} (first/last 3 steps); tool calls per episode "
              f"{r['calls_first']:.2f} -> {r['calls_last']:.2f}", flush=True)
    print(f"{time.perf_counter() - started:.0f} s; load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
