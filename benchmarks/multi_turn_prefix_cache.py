"""Multi-turn episodes on the ``hf`` engine with and without its prefix cache (``--engine.prefix_cache_tokens``).

Runs the same multi-turn workload (gcore's episode loop, ``run_episodes``: each turn's prompt is the episode so far,
then the reply, then an observation) on an engine with the prefix cache off (0) and one with it on, greedy, in
alternating repeats, and prints per run the episode wall time, the tokens per second (model tokens generated / wall
time) and the prompt tokens prefilled, then the ratio. The outputs must be equal: the script checks that every
trajectory's ids are identical and prints the largest log-probability difference.

    python benchmarks/multi_turn_prefix_cache.py                                   # the embedded tiny model
    python benchmarks/multi_turn_prefix_cache.py --model-path /tmp/smollm2-hf      # an HF checkpoint (gcore import)

The environment answers each turn with an observation of ``--obs-words`` tokens or so (a tool's output) and ends
the episode after ``--turns`` turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gcore import HFEngine, SamplingParams
from gcore.envs.base import Environment, Turn
from gcore.envs.episodes import run_episodes
from gcore.model import ModelConfig, ModelSource, load_tokenizer, materialize
from gcore.types import Prompt

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


class Tool(Environment):
    """Ends after ``turns`` turns; each other turn's observation is a tool-output-like text of about ``size`` tokens."""

    def __init__(self, turns: int, size: int, chat: bool, **kw: object) -> None:
        super().__init__(max_turns=turns, isolation="thread", **kw)  # type: ignore[arg-type]
        self.turns, self.size, self.chat = turns, size, chat

    def reset(self, prompt: Prompt) -> dict[str, int]:
        return {"turn": 0, "seed": prompt.index}

    def step(self, state: dict[str, int], response: str) -> Turn:
        state["turn"] += 1
        if state["turn"] >= self.turns:
            return Turn(reward=1.0, done=True)
        body = " ".join(WORDS[(state["seed"] * 7 + state["turn"] * 3 + i) % len(WORDS)] for i in range(self.size))
        text = f"result {state['turn']}: {body}"
        if self.chat:  # ChatML: the reply closed by <|im_end|> (its EOS), then a user turn and the next assistant turn
            text = f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        return Turn(observation=text, reward=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="an HF checkpoint folder (default: the embedded tiny model)")
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--obs-words", type=int, default=48, help="words per observation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = ModelConfig(path=args.model_path)
    tokenizer = load_tokenizer(config)
    path = args.model_path or materialize(config, tokenizer, 0, tempfile.mkdtemp(prefix="gcore-bench-"))
    chat = bool(getattr(tokenizer, "chat_template", None))
    env = Tool(args.turns, args.obs_words, chat)
    env.setup(tokenizer)
    prompts = []
    for i in range(args.episodes):
        question = (f"Task {i}: call the lookup tool until it has seen every result, then summarise what the tool "
                    "said in one line.")
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(question, add_special_tokens=False)
        prompts.append(Prompt(i, question, ids, ""))
    eos = tokenizer.eos_token_id
    params = SamplingParams(n=1, max_new_tokens=args.max_new_tokens, temperature=0.0,
                            stop_token_ids=(eos,) if eos is not None else ())

    engines = {}
    for name, tokens in (("uncached", 0), ("cached", args.cache_tokens)):
        engine = HFEngine(prefix_cache_tokens=tokens)
        engine.setup(ModelSource(path), torch.device("cpu"))
        engines[name] = engine
    print(f"model {args.model_path or 'embedded tiny'}; {args.episodes} episodes x {args.turns} turns, "
          f"<= {args.max_new_tokens} new tokens a turn, ~{args.obs_words}-word observations; "
          f"torch threads {args.threads}; load {os.getloadavg()[0]:.2f}", flush=True)
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    outputs = {}
    for repeat in range(args.repeats + 1):  # repeat 0 warms up, not counted
        for name, engine in (engines.items() if repeat % 2 == 0 else reversed(engines.items())):
            started = time.perf_counter()
            samples = run_episodes(env, engine.generate, prompts, params, tokenizer)
            wall = time.perf_counter() - started
            generated = sum(sum(s.response_mask) for s in samples)
            outputs[name] = samples
            if repeat:
                runs[name].append((wall, generated))
                print(f"repeat {repeat} {name:9s} wall {wall:7.3f} s  model tokens {generated:5d}  "
                      f"tokens/s {generated / wall:8.1f}  prefix hits {engine.prefix_stats['hit_tokens']:7d}",
                      flush=True)
    a, b = outputs["uncached"], outputs["cached"]
    same = all(x.response_ids == y.response_ids and x.response_mask == y.response_mask
               for x, y in zip(a, b, strict=True))
    gap = max((abs(u - v) for x, y in zip(a, b, strict=True)
               for u, v in zip(x.response_logprobs, y.response_logprobs, strict=True)), default=0.0)
    turns = statistics.mean(s.turns for s in b)
    length = statistics.mean(len(s.prompt.token_ids) + len(s.response_ids) for s in b)
    print(f"identical trajectories: {same}; largest |logprob difference|: {gap:.2e}; "
          f"mean turns {turns:.1f}, mean final length {length:.0f} tokens")
    median = {name: statistics.median(w for w, _ in r) for name, r in runs.items()}
    rate = {name: statistics.median(g / w for w, g in r) for name, r in runs.items()}
    print(f"median wall: uncached {median['uncached']:.3f} s, cached {median['cached']:.3f} s; "
          f"tokens/s: uncached {rate['uncached']:.1f}, cached {rate['cached']:.1f}; "
          f"speed-up x{median['uncached'] / median['cached']:.2f}")
    paired = [u / c for (u, _), (c, _) in zip(runs["uncached"], runs["cached"], strict=True)]
    print("per-repeat speed-up (the two runs of a repeat are adjacent in time): "
          + ", ".join(f"x{r:.2f}" for r in paired) + f"; load now {os.getloadavg()[0]:.2f}")
    print("cached engine's prefix cache:", engines["cached"].prefix_stats)
    if not same:
        sys.exit("the cached engine's trajectories differ from the uncached one's")


if __name__ == "__main__":
    main()
