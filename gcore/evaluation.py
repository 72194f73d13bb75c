"""Held-out evaluation: the policy's accuracy on prompts it does not train on, with the rollout engine.

``--trainer.eval_every N`` runs it inside ``gcore fit`` (before the first step, every N steps, and
after the last one); ``gcore eval`` runs it once on a checkpoint. Each prompt gets one greedy
completion and one at the training temperature; the metrics are the mean reward of each, which for
a 0/1 reward such as ``math`` is the share answered correctly:

- ``eval/accuracy_greedy``: temperature 0 (the model's best guess);
- ``eval/accuracy_sampled``: ``--sampling.temperature`` (what training samples see);
- ``eval/prompts``, ``time/eval``.

With several controllers each evaluates its share of the prompts and the sums are all-reduced.

With a multi-turn environment (``--env``) each completion is a whole episode, run by the same episode
loop as training (``gcore/envs/episodes.py``); its score is the reward model's plus the environment's
own rewards, as in training. ``eval/turns_mean`` is then the mean number of model turns per greedy
episode.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from gcore.engines.base import Engine, generate_prompts
from gcore.envs.base import Environment
from gcore.envs.episodes import run_episodes
from gcore.rewards.base import RewardModel
from gcore.types import Prompt, Sample, SamplingParams

MODES = ("greedy", "sampled")


def evaluate(engine: Engine, reward: RewardModel, tokenizer, prompts: Sequence[Prompt],  # noqa: ANN001
             sampling: SamplingParams, fabric=None, env: Environment | None = None) -> dict[str, float]:  # noqa: ANN001
    """Mean reward of one greedy and one sampled completion (or episode, with a multi-turn ``env``) per prompt
    (see the module docstring)."""
    start = time.perf_counter()
    rank, world = (fabric.global_rank, fabric.world_size) if fabric is not None else (0, 1)
    mine = list(prompts)[rank::world]
    episodes = env is not None and env.multi_turn
    sums = torch.zeros(len(MODES) + 2, dtype=torch.float64)
    sums[-1] = len(mine)
    for i, mode in enumerate(MODES):
        params = replace(sampling, n=1, temperature=0.0 if mode == "greedy" else sampling.temperature)
        samples = _complete(engine, tokenizer, mine, params, env if episodes else None)
        sums[i] = float(sum(reward.score(samples)) + sum(s.env_reward for s in samples)) if samples else 0.0
        if mode == "greedy":
            sums[-2] = float(sum(s.turns for s in samples))
    if world > 1:
        sums = fabric.all_reduce(sums, reduce_op="sum")
    count = max(float(sums[-1]), 1.0)
    metrics = {f"eval/accuracy_{mode}": float(sums[i]) / count for i, mode in enumerate(MODES)}
    metrics["eval/prompts"] = float(sums[-1])
    if episodes:
        metrics["eval/turns_mean"] = float(sums[-2]) / count
    metrics["time/eval"] = time.perf_counter() - start
    return metrics


def _complete(engine: Engine, tokenizer, prompts: list[Prompt], params: SamplingParams,  # noqa: ANN001
              env: Environment | None) -> list[Sample]:
    """One completion per prompt: a single generation, or an episode of the multi-turn ``env``."""
    if not prompts:
        return []
    if env is not None:
        return run_episodes(env, engine.generate, prompts, params, tokenizer)
    outputs = generate_prompts(engine, prompts, params)
    return [
        Sample(prompt=p, group=j, response_ids=g.token_ids, response_logprobs=g.logprobs,
               response_text=tokenizer.decode(g.token_ids, skip_special_tokens=True), finished=g.finished)
        for j, (p, generations) in enumerate(zip(prompts, outputs, strict=False))
        for g in generations
    ]
