"""Re-runs the bad-input cases of the reliability review as CLI runs and counts how each one ends.

Each case is ``gcore fit`` with ``--trainer.max_steps 2``, a 1-layer model and small settings, plus
the case's bad option, model folder, data file or reward function (fixtures are written to a temp
folder). A case ends as

- ``clear``: exit status 2 and a ``gcore: error: ...`` line that names the problem (the case's
  keyword), no traceback (jsonargparse's errors come after a usage dump);
- ``unclear``: exit status 2 and an error line, but not naming the problem;
- ``crash``: a Python traceback, or any other non-zero status;
- ``silent``: exit status 0 (the bad input was accepted).

Prints one row per case, then ``bad inputs tried / clear / unclear / silent / crash``.

    python benchmarks/bad_inputs.py             # all 41 cases, sequentially (about 6 min on 2 cores)
    python benchmarks/bad_inputs.py -k reward   # the cases whose name contains "reward"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

SMALL = ["--trainer.enable_progress_bar", "false", "--trainer.max_steps", "2", "--data.prompts_per_step", "4",
         "--sampling.n", "4", "--sampling.max_new_tokens", "4", "--model.num_hidden_layers", "1",
         "--model.hidden_size", "32", "--model.intermediate_size", "64"]

REWARDS = '''
import math
calls = 0
def ok(prompt, response, answer):
    return float(answer in response)
def raise_one(prompt, response, answer):
    global calls
    calls += 1
    if calls == 20:
        raise ValueError("boom on call 20")
    return 1.0
notcallable = 3
def nan(prompt, response, answer):
    return math.nan
def nan_some(prompt, response, answer):
    global calls
    calls += 1
    return math.nan if calls % 5 == 0 else 1.0
def inf(prompt, response, answer):
    return math.inf
def inf_some(prompt, response, answer):
    global calls
    calls += 1
    return math.inf if calls % 7 == 0 else 1.0
def string(prompt, response, answer):
    return "good"
def numstring(prompt, response, answer):
    return "0.5"
def none(prompt, response, answer):
    return None
'''


@dataclass
class Case:
    name: str
    args: list[str]
    keyword: str  # what a clear error names (case-insensitive)
    resume: bool = False  # runs against the checkpointed run


def fixtures(root: str) -> None:
    """Data files, reward functions, config files and broken model folders under ``root``."""
    import pandas as pd

    from gcore.model import ModelConfig, char_tokenizer, materialize

    rows = [{"prompt": "7=", "answer": "7"}] * 30

    def write(name: str, text: str) -> None:
        with open(os.path.join(root, name), "w") as f:
            f.write(text)

    write("good.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    write("empty.jsonl", "")
    lines = [json.dumps(r) for r in rows]
    lines[15] = '{"prompt": "7=" "answer": "7"}'
    write("malformed.jsonl", "\n".join(lines) + "\n")
    lines = [json.dumps(r) for r in rows]
    lines[12] = json.dumps({"question": "7=", "answer": "7"})
    write("nokey.jsonl", "\n".join(lines) + "\n")
    pd.DataFrame([{"question": "7=", "answer": "7"}] * 30).to_parquet(os.path.join(root, "wrongcol.parquet"))
    write("rewards.py", REWARDS)
    write("typo.yaml", "trainer:\n  checkpoint_evry: 1\n")
    write("typo_top.yaml", "trainr:\n  max_steps: 2\n")
    write("typo_plugin.yaml", "algorithm:\n  class_path: grpo\n  init_args:\n    klcoef: 0.1\n")
    config = ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    good = materialize(config, char_tokenizer(), 0, os.path.join(root, "model"))
    for name in ("notok", "corrupt", "trunc", "noweights", "badconfig"):
        shutil.copytree(good, os.path.join(root, name))
    for name in os.listdir(os.path.join(root, "notok")):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.remove(os.path.join(root, "notok", name))
    with open(os.path.join(root, "corrupt", "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 64)
    with open(os.path.join(root, "trunc", "model.safetensors"), "r+b") as f:
        f.truncate(50_000)
    os.remove(os.path.join(root, "noweights", "model.safetensors"))
    with open(os.path.join(root, "badconfig", "config.json"), "r+") as f:
        f.truncate(40)


def cases(fx: str) -> list[Case]:
    reward = ["--reward", "python", "--data.path", f"{fx}/good.jsonl", "--reward.function"]
    return [
        Case("model: no such folder", ["--model.path", f"{fx}/nonexistent"], "not a directory"),
        Case("model: no tokenizer files", ["--model.path", f"{fx}/notok"], "tokenizer"),
        Case("model: corrupt safetensors", ["--model.path", f"{fx}/corrupt"], "model.safetensors"),
        Case("model: truncated safetensors", ["--model.path", f"{fx}/trunc"], "model.safetensors"),
        Case("model: no weights", ["--model.path", f"{fx}/noweights"], "model.safetensors"),
        Case("model: truncated config.json", ["--model.path", f"{fx}/badconfig"], "config.json"),
        Case("data: no such file", ["--data.path", f"{fx}/nope.jsonl"], "no such file"),
        Case("data: empty", ["--data.path", f"{fx}/empty.jsonl"], "empty"),
        Case("data: malformed line 16", ["--data.path", f"{fx}/malformed.jsonl"], "malformed.jsonl:16"),
        Case("data: no prompt key on row 13", ["--data.path", f"{fx}/nokey.jsonl"], "nokey.jsonl:13"),
        Case("data: parquet without prompt column", ["--data.path", f"{fx}/wrongcol.parquet"], "prompt"),
        Case("reward: missing file", [*reward, f"{fx}/missing.py:ok"], "missing.py"),
        Case("reward: no such function", [*reward, f"{fx}/rewards.py:does_not_exist"], "does_not_exist"),
        Case("reward: not callable", [*reward, f"{fx}/rewards.py:notcallable"], "not callable"),
        Case("reward: no such package", [*reward, "no_such_pkg.mod:fn"], "no_such_pkg"),
        Case("reward: raises on call 20 (step 1)", [*reward, f"{fx}/rewards.py:raise_one"], "boom on call 20"),
        Case("reward: always NaN", [*reward, f"{fx}/rewards.py:nan"], "nan"),
        Case("reward: every 5th NaN", [*reward, f"{fx}/rewards.py:nan_some"], "nan"),
        Case("reward: always inf", [*reward, f"{fx}/rewards.py:inf"], "inf"),
        Case("reward: every 7th inf", [*reward, f"{fx}/rewards.py:inf_some"], "inf"),
        Case("reward: returns 'good'", [*reward, f"{fx}/rewards.py:string"], "good"),
        Case("reward: returns '0.5'", [*reward, f"{fx}/rewards.py:numstring"], "str"),
        Case("reward: returns None", [*reward, f"{fx}/rewards.py:none"], "none"),
        Case("--algorithm foo", ["--algorithm", "foo"], "valid choices"),
        Case("--sampling.n 0", ["--sampling.n", "0"], "sampling.n"),
        Case("--sampling.temperature -1", ["--sampling.temperature", "-1"], "temperature"),
        Case("--data.prompts_per_step 0", ["--data.prompts_per_step", "0"], "prompts_per_step"),
        Case("--trainer.max_steps -5", ["--trainer.max_steps", "-5"], "max_steps"),
        Case("--trainer.checkpoint_every -1", ["--trainer.checkpoint_every", "-1"], "checkpoint_every"),
        Case("--sampling.top_k -3", ["--sampling.top_k", "-3"], "top_k"),
        Case("--trainer.keep_checkpoints 0", ["--trainer.keep_checkpoints", "0"], "keep_checkpoints"),
        Case("--sampling.max_new_tokens 0", ["--sampling.max_new_tokens", "0"], "max_new_tokens"),
        Case("--trainer.devices 0", ["--trainer.devices", "0"], "devices"),
        Case("--data.prompts_per_step abc", ["--data.prompts_per_step", "abc"], "prompts_per_step"),
        Case("config: typo in a trainer key", ["--config", f"{fx}/typo.yaml"], "checkpoint_evry"),
        Case("config: typo in a group", ["--config", f"{fx}/typo_top.yaml"], "trainr"),
        Case("config: typo in a plugin option", ["--config", f"{fx}/typo_plugin.yaml"], "klcoef"),
        Case("resume: max_steps below the saved step", ["--trainer.max_steps", "5"], "max_steps", resume=True),
        Case("resume: another prompt set", ["--data.num_synthetic_prompts", "500"], "prompt", resume=True),
        Case("resume: another model size", ["--model.hidden_size", "64"], "size", resume=True),
        Case("resume: another algorithm", ["--algorithm", "ppo"], "--algorithm", resume=True),
    ]


def run(args: list[str], root: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", root, *SMALL, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def classify(result: subprocess.CompletedProcess, keyword: str) -> tuple[str, str]:
    """(``clear``/``unclear``/``crash``/``silent``, the line that says why)."""
    lines = result.stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error:") or ": error:" in line]
    last = lines[-1] if lines else ""
    if result.returncode == 0:
        return "silent", last
    if "Traceback" in result.stderr or result.returncode != 2 or not starts:
        return "crash", last
    message = " ".join(line.strip() for line in lines[starts[-1]:])  # jsonargparse's run over a few lines
    return ("clear" if keyword.lower() in message.lower() else "unclear"), message


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the cases whose name contains this")
    options = parser.parse_args()
    fx = tempfile.mkdtemp(prefix="gcore-bad-inputs-")
    try:
        fixtures(fx)
        chosen = [c for c in cases(fx) if options.k in c.name]
        saved = os.path.join(fx, "saved")
        if any(c.resume for c in chosen):  # a run with a checkpoint after step 11 to resume from
            first = run(["--trainer.max_steps", "12", "--trainer.checkpoint_every", "2"], saved)
            if first.returncode != 0:
                print(first.stderr, file=sys.stderr)
                return 1
        counts = {"clear": 0, "unclear": 0, "silent": 0, "crash": 0}
        print("| case | result | rc | s | last line |\n|---|---|---:|---:|---|")
        for case in chosen:
            root = saved if case.resume else os.path.join(fx, "runs")
            started = time.perf_counter()
            # a resumed case runs to step 14 (past the saved step 11) unless its own options say otherwise
            args = ["--trainer.max_steps", "14", "--trainer.resume", "auto", *case.args] if case.resume else case.args
            result = run(args, root)
            kind, line = classify(result, case.keyword)
            counts[kind] += 1
            line = line.replace("|", "\\|")
            print(f"| {case.name} | {kind} | {result.returncode} | {time.perf_counter() - started:.1f} | "
                  f"{line[:200]} |", flush=True)
        print(f"\nbad inputs tried: {len(chosen)}; clear one-line errors: {counts['clear']}; unclear: "
              f"{counts['unclear']}; silent: {counts['silent']}; crash: {counts['crash']}")
    finally:
        shutil.rmtree(fx, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
