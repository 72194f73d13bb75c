"""Helpers for testing gcore plugins: hand-made samples and batches, and a tiny end-to-end run.

A plugin author can check a reward on a ``make_sample``, an algorithm's formulas on a
``make_batch`` (``set_up`` before handing it to ``TrainingBackend.train``), and that the plugin
trains inside the real loop with ``tiny_fit``.
"""

from __future__ import annotations

import tempfile
from typing import Any, TypeVar

import torch

from gcore.algorithms.base import Algorithm
from gcore.data import DataConfig
from gcore.model import ModelConfig
from gcore.trainer import FitResult, Trainer, TrainerConfig
from gcore.types import Prompt, RolloutBatch, Sample, SamplingParams

A = TypeVar("A", bound=Algorithm)


def set_up(algorithm: A, max_new_tokens: int) -> A:
    """``algorithm`` after ``setup(max_new_tokens)`` (what the controller does before training), for
    a test that calls ``TrainingBackend.train`` itself."""
    algorithm.setup(max_new_tokens)
    return algorithm


def make_sample(prompt: str, response: str, answer: str | None = None, group: int = 0) -> Sample:
    """A sample with the given texts (token ids are character codes; logprobs are 0)."""
    return Sample(
        prompt=Prompt(0, prompt, [ord(c) for c in prompt], answer, "<test>"),
        group=group,
        response_ids=[ord(c) for c in response],
        response_logprobs=[0.0] * len(response),
        response_text=response,
        finished=True,
    )


def make_batch(rewards: list[float], groups: list[int], length: int = 4) -> RolloutBatch:
    """A batch of ``len(rewards)`` sequences of ``length`` tokens, all response but the first."""
    b = len(rewards)
    mask = torch.ones(b, length - 1)
    mask[:, 0] = 0
    return RolloutBatch(
        input_ids=torch.zeros(b, length, dtype=torch.long),
        attention_mask=torch.ones(b, length, dtype=torch.long),
        response_mask=mask,
        rewards=torch.tensor(rewards, dtype=torch.float),
        group_ids=torch.tensor(groups, dtype=torch.long),
        engine_logprobs=torch.zeros(b, length - 1),
    )


def tiny_fit(
    steps: int = 2, prompts_per_step: int = 4, save_final: bool = False,
    **plugins: Any,  # noqa: ANN401  plugins of any family, passed on to Trainer
) -> FitResult:
    """Train a 1-layer model for a few steps on the embedded task with the given plugins (``save_final``:
    write the trained policy to ``result.final_model_dir``)."""
    root = tempfile.mkdtemp(prefix="gcore-test-")
    return Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=root, enable_progress_bar=False, save_final=save_final),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(prompts_per_step=prompts_per_step),
        sampling=SamplingParams(n=4, max_new_tokens=6),
        **plugins,
    ).fit()
