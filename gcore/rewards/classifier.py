"""``classifier`` reward: an HF sequence-classification checkpoint scored in batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gcore.errors import ConfigError
from gcore.rewards.base import RewardModel
from gcore.types import Sample


class ClassifierReward(RewardModel):
    """The score of a discriminative reward model on ``prompt + response``.

    Args:
        path: a local directory with the checkpoint and its tokenizer.
        label: which output logit is the reward (0 for a one-label reward model).
        batch_size: samples per forward pass.
        max_length: truncate inputs (from the left, keeping the response) to this many tokens.
        trust_remote_code: allow the checkpoint's own Python code.
    """

    def __init__(
        self, path: str, label: int = 0, batch_size: int = 16, max_length: int = 2048, trust_remote_code: bool = False
    ) -> None:
        if batch_size <= 0:
            raise ConfigError("--reward.batch_size must be positive")
        self.path, self.label, self.batch_size = path, label, batch_size
        self.max_length, self.trust_remote_code = max_length, trust_remote_code
        self.model: Any = None  # transformers model and tokenizer once set up
        self.tokenizer: Any = None
        self.device = torch.device("cpu")

    def setup(self, device) -> None:  # noqa: ANN001
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                self.path, trust_remote_code=self.trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise ConfigError(f"--reward.path {self.path}: cannot load a sequence classifier: {err}") from err
        if self.label >= self.model.config.num_labels:
            raise ConfigError(f"--reward.label {self.label}: the classifier has {self.model.config.num_labels} labels")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.model.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, samples: Sequence[Sample]) -> list[float]:
        if self.model is None:
            self.setup(None)
        self.last_errors = 0
        scores: list[float] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            texts = [s.prompt.text + s.response_text for s in chunk]
            enc = self.tokenizer(
                texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
            ).to(self.device)
            logits = self.model(**enc).logits.float()
            scores.extend(logits[:, self.label].tolist())
        return scores
