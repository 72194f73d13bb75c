"""On-policy distillation's teacher on an engine of its own (``--algorithm.teacher_engine``): ``TeacherScoring``.

Imported only where a run has one (``Distill.teacher_scoring``), so that it is no ``--reward`` choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gcore.engines.base import Engine
from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.rewards.base import Judge, RewardModel
from gcore.types import Prompt, Sample


class TeacherScoring(RewardModel):
    """The run's reward, and the on-policy distillation teacher on an engine of its own.

    ``score`` scores the samples with ``reward``, then asks the teacher's engine for the log-probability of each of
    their response tokens given the prompt and the tokens before it, at the sampling temperature
    (``Engine.token_logprobs``), and sets ``Sample.teacher_logprobs``: they go with the sample into the batch
    (``collate``), as the engine's sampling log-probabilities do. The teacher is a ``Judge`` of this reward, so a
    placement policy places its engine as it places a generative judge's: in the controller's process
    (``--placement static``), swapped in on every engine worker after generation (``--placement.workers``), on
    the judge partition (``--placement dynamic``, whose ``placement/judge_devices`` is the teacher's share).

    Args:
        reward: the run's reward (its own judges, if any, come first in ``judges``).
        engine: the teacher's engine, configured but not set up (``--algorithm.teacher_engine``).
        source: the teacher checkpoint (``--algorithm.teacher``).
        temperature: the sampling temperature (the teacher's logits are divided by it, as the trainer's are).
        batch_size: sequences per engine call.
    """

    def __init__(self, reward: RewardModel, engine: Engine, source: ModelSource, temperature: float,
                 batch_size: int = 64) -> None:
        self.reward, self.engine, self.configured = reward, engine, engine
        self.source, self.temperature, self.batch_size = source, temperature, batch_size
        #: response tokens the teacher scored in the last ``score`` (and in all, ``scored_tokens``)
        self.last_teacher_tokens = 0
        self.scored_tokens = 0

    def setup(self, device) -> None:  # noqa: ANN001
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.engine.setup(self.source, device)  # a no-op where a placement gave it a pool's engine (``_use_engine``)
        self.reward.setup(device)

    @property
    def teacher_source(self) -> ModelSource:
        """The teacher checkpoint (the trainer checks its vocabulary against the student's)."""
        return self.source

    @property
    def users_reward(self) -> RewardModel:
        """The run's reward as configured (what evaluation scores and the run's config records)."""
        return self.reward

    def judges(self) -> list[Judge]:
        return [*self.reward.judges(), Judge(self.configured, self.source, self._use_engine)]

    def _use_engine(self, engine: Engine) -> None:
        self.engine = engine

    def judged(self, prompt: Prompt) -> bool:
        return True  # the teacher scores every sample

    def score(self, samples: Sequence[Sample]) -> list[float]:
        self.last_errors, self.last_error = 0, None
        scores = self.score_part(self.reward, samples)
        for sample in samples:
            if sample.prompt.visual is not None:
                raise ConfigError("--algorithm.teacher_engine: the teacher engine scores text prompts only; this "
                                  f"prompt ({sample.prompt.source or sample.prompt.index}) has images (use the "
                                  "trainer's teacher: no --algorithm.teacher_engine)")
        self.last_teacher_tokens = 0
        samples = list(samples)
        for first in range(0, len(samples), self.batch_size):
            chunk = samples[first : first + self.batch_size]
            rows = self.engine.token_logprobs([list(s.prompt.token_ids) + list(s.response_ids) for s in chunk],
                                              [len(s.prompt.token_ids) for s in chunk], self.temperature)
            if len(rows) != len(chunk):
                raise RuntimeError(f"the teacher engine returned {len(rows)} rows for {len(chunk)} samples")
            for sample, row in zip(chunk, rows, strict=True):
                if len(row) != len(sample.response_ids):
                    raise RuntimeError(f"the teacher engine returned {len(row)} log-probabilities for "
                                       f"{len(sample.response_ids)} response tokens")
                sample.teacher_logprobs = [float(x) for x in row]
                self.last_teacher_tokens += len(row)
        self.scored_tokens += self.last_teacher_tokens
        return scores
