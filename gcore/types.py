"""The data that flows between the stages of a step (docs/concepts.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, cast

import torch

from gcore.errors import ConfigError


@dataclass
class VisualInputs:
    """One prompt's images as its model takes them: the processor's tensors other than the token ids
    (Qwen2-VL: ``pixel_values`` ``[patches, dim]`` and ``image_grid_thw`` ``[images, 3]``). A batch's are
    the rows' concatenated along the first dimension (``concat_visual``), in row order: the order of the
    image tokens in the batch."""

    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def concat_visual(rows: Sequence[VisualInputs | None]) -> dict[str, torch.Tensor]:
    """The keyword arguments of a model call on ``rows`` (rows without images give nothing): each tensor
    of the rows that have images, concatenated along its first dimension; ``{}`` when none has."""
    present = [row for row in rows if row is not None]
    if not present:
        return {}
    return {key: torch.cat([row.tensors[key] for row in present]) for key in present[0].tensors}


@dataclass
class Prompt:
    """One prompt of the dataset, tokenized once at load time."""

    index: int  # row in the dataset (stable across epochs and ranks)
    text: str
    token_ids: list[int]
    answer: str | None = None
    source: str = ""  # "file:line", for error messages
    metadata: dict[str, Any] = field(default_factory=dict)
    #: the user message before ``--data.chat_template`` wrapped it (``None``: ``text`` itself); what an
    #: environment that renders its own conversation (``--env tools``) starts from
    content: str | None = None
    #: the prompt's images, processed (``--data.image_key``, a visual task); their tokens are in ``token_ids``
    visual: VisualInputs | None = None


@dataclass
class SamplingParams:
    """How an engine samples completions.

    Args:
        n: completions per prompt (the group size of GRPO/DAPO).
        max_new_tokens: the generation budget per completion.
        temperature: sampling temperature; the trainer's log-probabilities use the same one.
        top_p: nucleus sampling threshold (1 disables it).
        top_k: sample among the k likeliest tokens (0 disables it).
        stop_token_ids: extra token ids that end a completion (the tokenizer's EOS always does).
    """

    n: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: tuple[int, ...] = ()

    def validate_for_training(self) -> None:
        """A one-line ``ConfigError`` for the first value RL sampling cannot use (evaluation may
        sample greedily: temperature 0 is refused only here)."""
        checks = [
            (self.n >= 1, f"--sampling.n must be >= 1, got {self.n}"),
            (self.max_new_tokens >= 1, f"--sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature > 0, f"--sampling.temperature must be > 0 for RL sampling, got {self.temperature}"),
            (0 < self.top_p <= 1, f"--sampling.top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"--sampling.top_k must be >= 0 (0: no top-k), got {self.top_k}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass
class Generation:
    """One completion from an engine: sampled tokens and their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # True when it ended on a stop token, False when cut at max_new_tokens
    #: partial rollouts (``--trainer.partial_rollouts``): for each token, how many weight updates the engine had
    #: loaded during this request before it sampled the token (0: the weights the request was sent to). ``None``:
    #: no update came during the request (every token 0).
    versions: list[int] | None = None
    #: a mixture-of-experts model's routes (``--engine.record_routes``): ``[P + R - 1, layers, k]`` int16, the experts
    #: each MoE layer routed the prompt's ``P`` tokens and the first ``R - 1`` sampled tokens to (the last is never
    #: run); -1 where not recorded. ``None``: not recorded
    routed_experts: torch.Tensor | None = None


@dataclass
class Sample:
    """One completion of one prompt as it moves through reward, filtering and training."""

    prompt: Prompt
    group: int  # samples of the same prompt in the same step share a group id
    response_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    finished: bool
    reward: float = 0.0
    reward_info: dict[str, float] = field(default_factory=dict)
    #: the weights that generated it: the number of training steps (updates) they had had. A sample
    #: trained at step ``s`` is ``s - policy_version`` versions old (0 in the synchronous loop).
    policy_version: int = 0
    #: multi-turn episodes (``--env``, docs/agents.md): 1 where ``response_ids`` holds a token the model
    #: generated, 0 where it holds an observation's token (context, never trained); ``None``: all the
    #: model's (one turn). ``response_logprobs`` is 0 at observation tokens.
    response_mask: list[int] | None = None
    turns: int = 1  # model turns in the episode
    #: partial rollouts (``--trainer.partial_rollouts``): the policy version that sampled each response token
    #: (``policy_version`` for the tokens sampled before a weight update came, one more per update since);
    #: ``None``: every token ``policy_version``'s
    token_versions: list[int] | None = None
    env_reward: float = 0.0  # the sum of the environment's rewards for the turns (added to the reward model's)
    #: ``Generation.routed_experts`` (one turn): the experts the engine routed each token of prompt + response to
    routed_experts: torch.Tensor | None = None
    #: an episode's environment counts summed over its turns (``Turn.metrics``: ``tool_calls``, ``tool_errors``, ...)
    env_metrics: dict[str, float] = field(default_factory=dict)
    #: on-policy distillation with the teacher on an engine of its own (``--algorithm.teacher_engine``): the
    #: teacher's log-probability of each response token (at the sampling temperature), as the engine scored it;
    #: ``None``: not scored there (the backend's teacher computes them, or there is no teacher)
    teacher_logprobs: list[float] | None = None


@dataclass
class RolloutBatch:
    """A padded tensor view of a list of samples, ready for the training backend.

    Sequences are prompt + response, right-padded to one length ``L``. Per-token tensors have
    shape ``[B, L-1]``: position ``t`` holds the prediction of token ``t+1``; ``response_mask`` is 1
    exactly where that token belongs to the response.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float
    rewards: torch.Tensor  # [B]
    group_ids: torch.Tensor  # [B]
    engine_logprobs: torch.Tensor  # [B, L-1] logprobs reported by the engine (0 off-response)
    temperature: float = 1.0
    old_logprobs: torch.Tensor | None = None  # [B, L-1] before this step's updates
    ref_logprobs: torch.Tensor | None = None  # [B, L-1] under the reference model
    teacher_logprobs: torch.Tensor | None = None  # [B, L-1] under the teacher (``Algorithm.teacher_path``)
    values: torch.Tensor | None = None  # [B, L-1] critic values (PPO)
    advantages: torch.Tensor | None = None  # [B] or [B, L-1]
    returns: torch.Tensor | None = None  # [B, L-1] (PPO)
    truncated: torch.Tensor | None = None  # [B] bool: the response was cut at max_new_tokens
    features: torch.Tensor | None = None  # [B, ...] a per-sample input such as an image (prompt.metadata["feature"])
    prompt_lengths: torch.Tensor | None = None  # [B] long: the response starts at this token index
    #: [B, L-1] the behaviour policy's log-probabilities (the engine's, 0 off-response), set only when the
    #: samples may be off-policy (``--trainer.max_staleness`` >= 1): the loss then weighs each token by
    #: the truncated importance weight proximal / behaviour (``Algorithm.loss``)
    behaviour_logprobs: torch.Tensor | None = None
    policy_versions: torch.Tensor | None = None  # [B] long: ``Sample.policy_version``, set with ``behaviour_logprobs``
    #: per row, the prompt's images (``Prompt.visual``; ``None``: a row without); ``None``: no row has any
    visual: list[VisualInputs | None] | None = None
    #: ``[B, L-1, layers, k]`` long: a mixture-of-experts policy's experts that the engine routed input token ``t`` to
    #: (``Sample.routed_experts``; -1 where none was recorded); ``None``: not recorded (``--backend.routing_replay``)
    routed_experts: torch.Tensor | None = None
    #: [B] long: each row's index in the batch ``collate`` made (``select`` keeps it), for the per-sample
    #: figures of rollout tracing (``gcore/tracing.py``)
    row_ids: torch.Tensor | None = None
    #: where ``Algorithm.loss`` appends ``(row_ids, gap)`` per micro-batch: each row's mean |trainer - engine|
    #: log-probability over its response tokens, from the forward pass the loss runs anyway (shared by the
    #: batch's selections; ``None``: not recorded)
    logprob_gaps: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> RolloutBatch:
        """Rows ``index`` of every tensor field, trimmed to the longest remaining sequence."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and f.name != "logprob_gaps":  # per-row objects (``visual``)
                if isinstance(index, slice):
                    rows = list(range(len(value))[index])
                else:
                    rows = (index.nonzero().flatten() if index.dtype == torch.bool else index.flatten()).tolist()
                value = [value[i] for i in rows]
            out[f.name] = value[index] if isinstance(value, torch.Tensor) else value
        sub = RolloutBatch(**out)
        length = int(sub.attention_mask.sum(-1).max().item()) if len(sub) else 1
        return sub.trim(max(length, 2))

    def trim(self, length: int) -> RolloutBatch:
        """Drop padding columns beyond ``length`` tokens."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and (value.dim() == 2 or f.name == "routed_experts") \
                    and f.name != "features":
                cut = length if value.shape[1] == self.input_ids.shape[1] else length - 1
                value = value[:, :cut]
            out[f.name] = value
        return RolloutBatch(**out)


def collate(samples: list[Sample], pad_id: int, temperature: float) -> RolloutBatch:
    """Pad samples into a ``RolloutBatch`` (right padding)."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    lengths = [len(s.prompt.token_ids) + len(s.response_ids) for s in samples]
    length = max(max(lengths), 2)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    response_mask = torch.zeros((batch, length - 1))
    engine_logprobs = torch.zeros((batch, length - 1))
    scored = [s.teacher_logprobs is not None for s in samples]
    if any(scored) and not all(scored):
        raise ValueError(f"{scored.count(False)} of {len(samples)} samples carry no teacher log-probabilities "
                         "(the teacher engine scores every sample of a step)")
    teacher_logprobs = torch.zeros((batch, length - 1)) if all(scored) else None
    for row, s in enumerate(samples):
        p, r = len(s.prompt.token_ids), len(s.response_ids)
        input_ids[row, : p + r] = torch.tensor(s.prompt.token_ids + s.response_ids, dtype=torch.long)
        attention_mask[row, : p + r] = 1
        if s.response_mask is None:
            response_mask[row, p - 1 : p + r - 1] = 1.0
        else:  # a multi-turn episode: the observations' tokens are context, not trained
            response_mask[row, p - 1 : p + r - 1] = torch.tensor(s.response_mask, dtype=torch.float)
        engine_logprobs[row, p - 1 : p + r - 1] = torch.tensor(s.response_logprobs, dtype=torch.float)
        if teacher_logprobs is not None and s.teacher_logprobs is not None:
            if len(s.teacher_logprobs) != r:
                raise ValueError(f"a sample has {len(s.teacher_logprobs)} teacher log-probabilities for {r} "
                                 "response tokens")
            teacher_logprobs[row, p - 1 : p + r - 1] = torch.tensor(s.teacher_logprobs, dtype=torch.float)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float),
        group_ids=torch.tensor([s.group for s in samples], dtype=torch.long),
        engine_logprobs=engine_logprobs,
        temperature=temperature,
        teacher_logprobs=teacher_logprobs,
        truncated=torch.tensor([not s.finished for s in samples], dtype=torch.bool),
        features=_stack_features(samples),
        prompt_lengths=torch.tensor([len(s.prompt.token_ids) for s in samples], dtype=torch.long),
        visual=[s.prompt.visual for s in samples] if any(s.prompt.visual is not None for s in samples) else None,
        routed_experts=_routes(samples, length),
    )


def _routes(samples: list[Sample], length: int) -> torch.Tensor | None:
    """The samples' ``routed_experts`` as ``[B, length-1, layers, k]`` long (-1 where none was recorded), or ``None``
    when no sample carries any."""
    present = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not present:
        return None
    out = torch.full((len(samples), length - 1, *present[0].shape[1:]), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        if s.routed_experts is not None:
            routes = s.routed_experts[: length - 1]
            out[row, : len(routes)] = routes.long()
    return out


def _stack_features(samples: list[Sample]) -> torch.Tensor | None:
    """The samples' ``prompt.metadata["feature"]`` tensors stacked, or ``None`` when they carry none."""
    features = [s.prompt.metadata.get("feature") for s in samples]
    if all(f is None for f in features):
        return None
    if any(f is None for f in features):
        raise ValueError("some samples carry a prompt.metadata['feature'] and others do not")
    return torch.stack(cast("list[torch.Tensor]", features))  # none is None (checked above)
