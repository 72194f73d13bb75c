"""Does a model call the calculator before any training? Valid calls and right answers on arithmetic problems.

GRPO can reinforce tool use only if some sampled episodes use the tool and answer right. This samples
``--prompts`` training problems of the embedded arithmetic task (``--digits``), ``--n`` episodes each, with
``--env tools --env.tools [calculator]`` in three settings:

- ``tools``: the tools described in the system message (the template cannot render ``tools=``);
- ``instructed``: the same, plus an instruction with a worked example of a call;
- ``prefilled``: the instruction, and the assistant turn starts with the call's opening
  ``<tool_call>\\n{"name": "calculator", "arguments": {"expression": "`` (written for the model);
- ``examples``: the tools described, and four worked examples as earlier turns
  (``--env.examples examples/real_model/calculator_examples.jsonl``).

Prints, per setting: the turns with a call, the valid calls (no tool error), the episodes the ``math``
reward scores right, and the answers right among the episodes with a valid call.

    python benchmarks/tool_use_probe.py --model /path/to/SmolLM2-135M-Instruct-hf
"""

import argparse
from pathlib import Path

import torch

from gcore.data import DataConfig, load_prompts
from gcore.engines.hf import HFEngine
from gcore.envs.episodes import EpisodeStats, run_episodes
from gcore.envs.tool_env import ToolEnvironment
from gcore.model import ModelConfig, ModelSource, load_tokenizer
from gcore.rewards.math import MathReward
from gcore.types import SamplingParams

INSTRUCTION = ('Always compute with the calculator tool first. For example, for "What is 12 plus 30?" reply exactly:\n'
               '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+30"}}\n</tool_call>\n'
               'Then, after the result, reply "The answer is 42."')
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "real_model" / "calculator_examples.jsonl"
PREFIX = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'


class Prefilled(ToolEnvironment):
    """The first assistant turn starts with ``PREFIX`` (prompt tokens, not the model's)."""

    def prompt_ids(self, prompt):
        return super().prompt_ids(prompt) + self.tokenizer.encode(PREFIX, add_special_tokens=False)

    def step(self, state, response):
        if not state.get("started"):
            state["started"] = True
            response = PREFIX + response
        return super().step(state, response)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint folder with a chat template")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--digits", type=int, nargs=2, default=(1, 2))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", nargs="+", default=["tools", "instructed", "prefilled", "examples"])
    args = parser.parse_args()

    tokenizer = load_tokenizer(ModelConfig(path=args.model))
    prompts = load_prompts(DataConfig(task="arithmetic", task_digits=tuple(args.digits), chat_template=True),
                           tokenizer, args.new_tokens, None)[: args.prompts]
    engine = HFEngine()
    engine.setup(ModelSource(args.model), torch.device("cpu"))
    params = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    settings = {"tools": ToolEnvironment(tools=["calculator"], max_turns=3),
                "instructed": ToolEnvironment(tools=["calculator"], system_prompt=INSTRUCTION, max_turns=3),
                "prefilled": Prefilled(tools=["calculator"], system_prompt=INSTRUCTION, max_turns=3),
                "examples": ToolEnvironment(tools=["calculator"], examples=str(EXAMPLES), max_turns=3)}
    for name in args.settings:
        env = settings[name]
        env.setup(tokenizer)
        torch.manual_seed(args.seed)
        stats = EpisodeStats()
        samples = run_episodes(env, engine.generate, prompts, params, tokenizer, stats=stats)
        right = [score > 0.5 for score in MathReward().score(samples)]
        calls, errors = stats.counts.get("tool_calls", 0.0), stats.counts.get("tool_errors", 0.0)
        used = [s.turns > 1 for s in samples]
        print(f"{name:10s} episodes {len(samples)}  calls {calls:.0f}  valid calls {calls - errors:.0f}  "
              f"right {sum(right)}  right after a call {sum(r and u for r, u in zip(right, used, strict=True))}  "
              f"errors {dict((k, v) for k, v in stats.counts.items() if k.startswith('tool_errors/'))}", flush=True)


if __name__ == "__main__":
    main()
