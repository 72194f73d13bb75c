"""The rollout ``Engine`` contract."""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, TypeAlias

import torch

from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.types import Generation, Prompt, SamplingParams, VisualInputs

#: the roles an engine worker process holds (``gcore/engines/pool/``; the placement policies assign them): the
#: policy's engine, the generative judge's engine, or a rule-based reward. Spelled here, not in ``pool.py``, so
#: that naming one loads no ``PoolEngine`` (an ``Engine`` the CLI would then list among the ``--engine`` choices)
Role: TypeAlias = Literal["policy", "judge", "reward"]
POLICY: Final = "policy"
JUDGE: Final = "judge"
REWARD: Final = "reward"


#: each prompt's images, in the order of the prompts (``Prompt.visual``: ``None`` for a prompt without any), as
#: ``generate`` and ``next_token_logprobs`` take them
Visual: TypeAlias = Sequence[VisualInputs | None]


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine supports beyond the core of the contract: the one place an engine declares it
    (``Engine.capabilities``), and the one place the trainer, the placement policies, the engine workers and the
    generative reward read it. docs/engines.md, "The contract"."""

    #: ``generate``, and ``next_token_logprobs`` where the engine gives them, take each prompt's images
    #: (``visual``): image prompts (docs/multimodal.md). Without it an engine refuses them in one line
    images: bool = False
    #: ``generate`` calls ``Engine.interrupt`` between decoding steps and, once it returns True, stops and returns
    #: what it has: partial rollouts (``--trainer.partial_rollouts``)
    interrupt: bool = False
    #: ``setup`` starts processes of its own (SGLang's scheduler): an engine worker that holds such an engine is
    #: started non-daemonic, since a daemonic process cannot have children (``gcore/engines/pool/``)
    starts_processes: bool = False
    #: ``generate`` can record, for a mixture-of-experts model, the experts every token was routed to
    #: (``Generation.routed_experts``) once its ``record_routes`` attribute is set: ``--backend.routing_replay``
    #: (docs/moe.md)
    routes: bool = False


#: where engines once declared their capabilities, one attribute each (now ``EngineCapabilities``)
_FORMER_CAPABILITIES = ("supports_images", "supports_interrupt", "starts_processes")


class Engine(ABC):
    """Generates ``n`` completions per prompt, with the log-probability of every sampled token.

    Lifecycle: ``setup`` loads the model from an HF checkpoint directory; ``generate`` is called
    once or more per step; ``update_weights`` receives the trainer's new weights after each
    optimizer step; ``sleep``/``wake_up`` release and retake device memory when placement asks.

    What an engine supports beyond that it declares in ``capabilities`` (``EngineCapabilities``): a class
    attribute, or an instance's own, set in ``__init__``, where the engine's options decide it. An engine whose
    capabilities say ``images`` takes each prompt's images in ``generate`` (and ``next_token_logprobs``) as
    ``visual``; one that does not refuses them (``refuse_images``). Callers pass ``visual`` only when a prompt
    has images, so an engine written for token ids alone need not name the parameter.
    """

    #: what this engine supports (images, interruption, processes of its own); default: none of it
    capabilities: EngineCapabilities = EngineCapabilities()
    #: partial rollouts (``--trainer.partial_rollouts``): set by the process that serves the engine; an engine
    #: whose capabilities say ``interrupt`` calls it between decoding steps and, once it returns True, stops and
    #: returns what it has (a generation cut there is neither finished nor at ``max_new_tokens``)
    interrupt: Callable[[], bool] | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        old = [name for name in _FORMER_CAPABILITIES if name in cls.__dict__]
        if old:  # the names of an earlier contract, which nothing reads now: refused rather than ignored
            raise TypeError(f"engine {cls.__name__} sets {', '.join(old)}: an engine declares what it supports in "
                            "capabilities = EngineCapabilities(images=..., interrupt=..., starts_processes=...) "
                            "(docs/engines.md, \"Writing an engine\")")

    @abstractmethod
    def setup(self, source: ModelSource, device: torch.device) -> None:
        """Load the model ``source`` names onto ``device``."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 visual: Visual | None = None) -> list[list[Generation]]:
        """For each prompt (token ids) return ``params.n`` generations. ``visual``: each prompt's images (given
        only when a prompt has some); an engine without ``capabilities.images`` refuses them (``refuse_images``)."""

    @abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load new weights (HF parameter names); return the number of bytes received."""

    def next_token_logprobs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int],
                            visual: Visual | None = None) -> list[list[float]]:
        """For each prompt (token ids), the log-probability of each of ``candidates`` (token ids) as the
        very next token, at temperature 1: what a judge's verdict is read from (``--reward.verdict
        probability``); ``visual``: each prompt's images, as ``generate`` takes them. An engine without it
        raises ``NotImplementedError``."""
        raise NotImplementedError(f"the {type(self).__name__} engine does not give next-token log-probabilities")

    def token_logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                       temperature: float = 1.0) -> list[list[float]]:
        """For each sequence (token ids), the log-probability of each of its tokens from ``starts[i]`` on given the
        tokens before it, at ``temperature`` (the logits divided by it, as the trainer does): scoring given tokens,
        what an on-policy distillation teacher on an engine of its own gives (``--algorithm.teacher_engine``).
        ``starts[i]`` >= 1. An engine without it raises ``NotImplementedError``."""
        raise NotImplementedError(f"the {type(self).__name__} engine does not score given tokens (token_logprobs)")

    def refuse_images(self, visual: Visual | None) -> None:
        """Raise a one-line ``ConfigError`` naming this engine when ``visual`` carries images and its
        capabilities do not say ``images``; what an engine's ``generate`` calls first where it takes none."""
        if visual is not None and not self.capabilities.images and any(v is not None for v in visual):
            raise ConfigError(f"the {type(self).__name__} engine does not generate from image prompts; "
                              "use --engine hf or vllm")

    def sleep(self) -> None:
        """Release device memory until ``wake_up`` (no-op by default)."""

    def wake_up(self) -> None:
        """Take device memory back after ``sleep`` (no-op by default)."""

    def shutdown(self) -> None:
        """Free everything; the engine is not used again."""


def generate_prompts(engine: Engine, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Generation]]:
    """``engine.generate`` on the prompts' token ids, with their images (``visual``) when they have any."""
    token_ids = [p.token_ids for p in prompts]
    if all(p.visual is None for p in prompts):
        return engine.generate(token_ids, params)
    visual = [p.visual for p in prompts]
    engine.refuse_images(visual)
    return engine.generate(token_ids, params, visual=visual)


def buckets(weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group named tensors into lists of at most ``max_bytes`` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


#: generation-config fields that change what ``model.generate`` samples, each with the value that changes nothing
#: (transformers' ``GenerationConfig`` defaults; ``top_k`` is read from the checkpoint's file only, as
#: transformers' global default of 50 applies to ``generate`` calls that set no ``top_k`` at all)
SAMPLING_FIELDS: dict[str, object] = {
    "temperature": 1.0, "top_k": None, "top_p": 1.0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
    "min_length": 0, "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "do_sample": False,
}


def ignored_generation_values(generation: object) -> dict[str, object]:
    """The sampling values a checkpoint's generation config sets that gcore's engines ignore: those of
    ``SAMPLING_FIELDS`` that differ from their no-op value (``top_k`` 0 counts as no-op too; ``do_sample`` is
    left out: the engines sample whenever the temperature is above 0)."""
    out = {}
    for name, neutral in SAMPLING_FIELDS.items():
        value = getattr(generation, name, neutral)
        if name == "do_sample" or value is None or value == neutral or (name == "top_k" and value == 0):
            continue
        out[name] = value
    return out


def warn_ignored_generation_values(logger: logging.Logger, path: str, generation: object, engine: str) -> None:
    """Log a warning naming the sampling values of a checkpoint's generation config (``generation``, or ``None``
    when it has none) that ``engine`` ignores: every engine samples with ``SamplingParams`` alone, where
    ``model.generate`` (and TRL's GRPOTrainer, for the values it does not set itself) would apply them."""
    ignored = ignored_generation_values(generation) if generation is not None else {}
    if ignored:
        logger.warning("%s: generation_config.json sets %s, which the %s engine ignores (it samples with "
                       "--sampling.* alone; model.generate would apply them: docs/engines.md, \"Sampling\")",
                       path, ", ".join(f"{k}={v!r}" for k, v in ignored.items()), engine)


def checkpoint_generation_config(path: str) -> object | None:
    """The checkpoint's ``generation_config.json`` as transformers reads it; ``None`` when it has none."""
    from transformers import GenerationConfig

    # read as JSON, never as code: from_pretrained would also look for the file on the model hub
    file = Path(path) / "generation_config.json"
    return GenerationConfig.from_dict(json.loads(file.read_text())) if file.is_file() else None


def scores_tokens(engine: Engine) -> bool:
    """Whether ``engine``'s class implements ``token_logprobs`` (the base one raises)."""
    return type(engine).token_logprobs is not Engine.token_logprobs
