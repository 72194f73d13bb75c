"""Multi-turn rollouts with a slow, long-tailed tool: generation overlapped with the tool calls, or not.

Runs the episode loop (``gcore/envs/episodes.py``) on the ``hf`` engine in this process, with an
environment whose every ``step`` sleeps like a tool call: most calls take ``--fast-s``, one in
``--slow-every`` takes ``--slow-s`` (the same calls are slow in both settings: the delay is drawn from
the episode and the turn). ``--env.overlap true`` generates the turns of the episodes whose result is
back while the others wait; ``false`` makes one batch per turn. Alternated, ``--repeats`` times each;
prints episodes/s, the engine's idle share (the loop's wait for observations with nothing to
generate, over the wall time) and the ratio.

    python benchmarks/agents_overlap.py                       # the embedded tiny model
    python benchmarks/agents_overlap.py --model /path/to/SmolLM2-135M-Instruct-hf --new-tokens 24
    python benchmarks/agents_overlap.py --model /path/to/SmolLM2-135M-Instruct-hf --new-tokens 24 --device cuda
"""

import argparse
import statistics
import tempfile
import time
import zlib

import torch

from gcore.engines.hf import HFEngine
from gcore.envs import Environment, Turn
from gcore.envs.episodes import EpisodeStats, run_episodes
from gcore.model import ModelConfig, ModelSource, load_tokenizer, materialize
from gcore.types import Prompt, SamplingParams


class SlowTool(Environment):
    """Every turn calls a tool that sleeps; the episode ends after ``turns`` turns."""

    def __init__(self, turns, fast_s, slow_s, slow_every, overlap):
        super().__init__(max_turns=turns, workers=64, overlap=overlap)
        self.turns, self.fast_s, self.slow_s, self.slow_every = turns, fast_s, slow_s, slow_every

    def reset(self, prompt):
        return {"id": prompt.index, "turn": 0, "episode": None}

    def step(self, state, response):
        state["turn"] += 1
        if state["turn"] >= self.turns:
            return Turn(done=True)
        key = zlib.crc32(f"{state['id']}-{id(state)}-{state['turn']}".encode())
        time.sleep(self.slow_s if key % self.slow_every == 0 else self.fast_s)
        return Turn(observation=f"|{state['turn']}=")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="an HF checkpoint folder (default: the embedded tiny model)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--fast-s", type=float, default=0.02)
    parser.add_argument("--slow-s", type=float, default=1.0)
    parser.add_argument("--slow-every", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the engine runs (cpu, cuda)")
    args = parser.parse_args()

    config = ModelConfig(path=args.model) if args.model else ModelConfig()
    tokenizer = load_tokenizer(config)
    path = args.model or materialize(config, tokenizer, 0, tempfile.mkdtemp())
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device(args.device))
    prompts = [Prompt(i, f"{i % 10}=", tokenizer(f"{i % 10}=")["input_ids"], str(i % 10)) for i in range(args.prompts)]
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    params = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, stop_token_ids=stop)
    rows = {True: [], False: []}
    for repeat in range(args.repeats):
        for overlap in (True, False) if repeat % 2 == 0 else (False, True):
            torch.manual_seed(repeat)
            stats = EpisodeStats()
            env = SlowTool(args.turns, args.fast_s, args.slow_s, args.slow_every, overlap)
            started = time.perf_counter()
            samples = run_episodes(env, engine.generate, prompts, params, tokenizer, stats=stats)
            wall = time.perf_counter() - started
            rows[overlap].append({"wall": wall, "episodes_per_s": len(samples) / wall,
                                  "idle_share": stats.env_wait_s / wall, "generate_s": stats.generate_s,
                                  "calls": stats.generate_calls})
            print(f"repeat {repeat} overlap={str(overlap).lower():5s} wall {wall:6.2f} s  "
                  f"episodes/s {len(samples) / wall:6.2f}  engine idle {stats.env_wait_s / wall:5.1%}  "
                  f"generate {stats.generate_s:6.2f} s in {stats.generate_calls} calls", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
    print(f"\nmedian over {args.repeats}: overlap true {med[True]['episodes_per_s']:.2f} episodes/s, idle "
          f"{med[True]['idle_share']:.1%}; false {med[False]['episodes_per_s']:.2f} episodes/s, idle "
          f"{med[False]['idle_share']:.1%}; overlap/no-overlap throughput "
          f"{med[True]['episodes_per_s'] / med[False]['episodes_per_s']:.2f}x")


if __name__ == "__main__":
    main()
