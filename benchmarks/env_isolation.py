"""Episodes/s of the embedded ``reveal`` environment with its calls in threads or in child processes.

``--env.isolation process`` (the default) sends each ``reset`` and ``step`` to a child process over a pipe
(the episode's state pickled there and back), so that a call past ``--env.timeout_s`` can be killed;
``thread`` runs them in threads of this process, as gcore did before. This measures what that costs per
episode: the episode loop (``run_episodes``) on the ``reveal`` task, 2 turns per episode, on

- ``engine``: the embedded tiny model on the ``hf`` engine (the CPU), as a test run does;
- ``stub``: a ``generate`` that returns fixed tokens at once, so that only the loop and the environment's
  calls are timed (the overhead per call, in the worst case for isolation).

The first rollout of each setting (which starts the child processes) is not timed; settings alternate,
``--repeats`` times each. Works on an older checkout too (without ``--env.isolation``: its threads).

    python benchmarks/env_isolation.py --repeats 5
"""

import argparse
import inspect
import statistics
import tempfile
import time

import torch

from gcore.engines.hf import HFEngine
from gcore.envs.episodes import run_episodes
from gcore.envs.reveal import RevealEnvironment
from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize
from gcore.types import Generation, Prompt, SamplingParams


def stub_generate(tokens):
    def generate(prompts, params):
        return [[Generation(list(tokens), [-1.0] * len(tokens), True) for _ in range(params.n)] for _ in prompts]

    return generate


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(), tokenizer, seed=0, workdir=tempfile.mkdtemp())
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    prompts = [Prompt(i, "?=", tokenizer("?=")["input_ids"], str(i % 10)) for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    has_isolation = "isolation" in inspect.signature(RevealEnvironment).parameters
    settings = ["process", "thread"] if has_isolation else ["thread (before)"]
    envs = {s: RevealEnvironment(**({"isolation": s} if has_isolation else {})) for s in settings}
    generates = {"engine": engine.generate, "stub": stub_generate(tokenizer("7777")["input_ids"])}
    for env in envs.values():
        env.setup(tokenizer)
        run_episodes(env, generates["stub"], prompts, params, tokenizer)  # warm-up: starts the processes
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for which, generate in generates.items():
            for setting, env in envs.items():
                started = time.perf_counter()
                samples = run_episodes(env, generate, prompts, params, tokenizer)
                seconds = time.perf_counter() - started
                assert all(s.turns == 2 and s.finished for s in samples)
                rates.setdefault((which, setting), []).append(len(samples) / seconds)
    print(f"{args.prompts} prompts x {args.n} episodes of 2 turns, {args.new_tokens} new tokens, "
          f"{args.repeats} repeats")
    print(f"{'generate':8} {'isolation':16} {'episodes/s (median)':>20} {'all':>30} {'ms per episode':>15}")
    for (which, setting), values in rates.items():
        median = statistics.median(values)
        print(f"{which:8} {setting:16} {median:20.1f} {' '.join(f'{v:.1f}' for v in values):>30} "
              f"{1000 / median:15.2f}")


if __name__ == "__main__":
    main()
