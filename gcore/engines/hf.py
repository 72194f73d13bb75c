"""``hf`` engine: a transformers model sampled in the controller's own process.

By default it samples with its own loop (one forward with a KV cache and one sampling step per
token, for the whole batch at once) instead of ``model.generate``: on CPU, ``generate``'s
per-token machinery (logits processors, stopping criteria, output bookkeeping) costs as much as
the tiny model's forward. ``use_generate=True`` goes back to ``model.generate``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from gcore.engines.base import Engine, EngineCapabilities, Visual, warn_ignored_generation_values
from gcore.engines.prefix_cache import LayerKV, PrefixCache, PrefixStats
from gcore.engines.static_cache import StaticCacheDecoder  # also imported from here (tests)
from gcore.errors import ConfigError
from gcore.model import DTYPES, ModelSource, cache_keyword, causal_lm_class, check_compiler
from gcore.types import Generation, SamplingParams, concat_visual

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import DynamicCache, GenerationMixin, PreTrainedModel

#: the decode step: the logits ``[rows, vocab]`` after feeding each decoded row's token ``chosen`` at step ``t``
#: (``active``: the rows still decoded, indices into the batch)
Advance = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]


class HFEngine(Engine):
    """Samples with ``transformers`` in-process; the CPU default and the reference engine.

    Args:
        max_batch_size: split generation into chunks of at most this many sequences (0: no limit).
        offload_when_asleep: on ``sleep`` move the weights to CPU memory (only useful on GPUs).
        use_generate: sample with ``model.generate`` instead of the engine's own loop (for models
            whose forward does not take ``past_key_values``/``position_ids`` the standard way).
        static_cache: decode Llama-style models (``llama``, ``qwen2``) with the engine's own decode
            step and a preallocated KV cache (``StaticCacheDecoder``); other architectures, or
            ``false``, decode through the model's forward with a growing ``DynamicCache``.
        cuda_graphs: on a CUDA device, capture the static-cache decoder's step once per batch shape as a CUDA
            graph and replay it for every token (one launch per token instead of one per kernel: the step of
            a small model is bound by kernel launches, not by the GPU). Ignored on CPU and without the
            static-cache decoder.
        dtype: the engine's copy of the weights: ``auto`` (the model's ``--model.dtype``, what the trainer
            holds) or ``bfloat16``/``float16``/``float32``; each weight sync casts the trainer's weights to it.
            A bfloat16 engine beside a float32 trainer samples from a slightly different distribution than
            the one trained (the metric ``rollout/logprob_diff`` says how far apart they are) and decodes
            faster where decoding is bound by reading the weights (BENCHMARKS.md measures it on CPU).
        sample_special_tokens: let the pad and bos tokens be sampled inside a response, as ``model.generate``
            (and TRL's GRPOTrainer) does. Off (the default), they are never sampled unless they are stop tokens:
            a pad token there would read as padding, and HF's embedding gives it no gradient. Where pad is
            the EOS token (most instruct checkpoints) only bos differs, and a trained model rarely puts
            mass on it; docs/engines.md, "Sampling".
        prefix_cache_tokens: keep the keys and values of the prompts prefilled, up to this many tokens in all (least
            recently used evicted first), so that a prompt extending one of them (a multi-turn episode's next turn)
            prefills only its new tokens; 0 turns it off. Dropped on every weight update and on ``sleep``; text
            prompts of the engine's own loop only (image prompts and ``use_generate`` bypass it). Each token held
            costs ``2 x layers x kv_heads x head_dim`` numbers of the engine's dtype; docs/engines.md, "Prefix cache".
        record_routes: a mixture-of-experts model (docs/moe.md): record, for every token the model ran on (the prompt's
            and each sampled token but the last), the experts each MoE layer routed it to
            (``Generation.routed_experts``), from hooks on the routers (``gcore.moe.RouterTap``) of the forwards the
            engine already runs; what ``--backend.routing_replay`` replays (it turns this on). Prompt tokens whose
            keys and values came from the prefix cache have no record (-1). Not with ``use_generate``.

    Sampling is ``SamplingParams`` alone (temperature, top-k, top-p): the checkpoint's
    ``generation_config.json`` gives only the eos, pad and bos ids; its sampling values (its own
    temperature, top_k, repetition_penalty, min_p, ...) are ignored, and ``setup`` logs a warning naming
    any that would change ``model.generate``'s samples (docs/engines.md, "Sampling"). The recorded
    log-probabilities are those of the model's own distribution, as with top-k and top-p.

    Image prompts (an image-text-to-text checkpoint, docs/multimodal.md): the prefill takes each prompt's visual
    inputs, and for a Qwen2-VL-style model its 3D positions (``gcore.vision.multimodal_positions``); the decode
    continues through the model's forward (no static-cache decoder) at each row's last position + 1. Not with
    ``use_generate``.

    Capabilities: images, and interruption between tokens (partial rollouts) with its own loop, not with
    ``use_generate`` (``model.generate`` does not stop when asked).
    """

    capabilities = EngineCapabilities(images=True, interrupt=True, routes=True)

    def __init__(
        self,
        max_batch_size: int = 0,
        offload_when_asleep: bool = True,
        use_generate: bool = False,
        static_cache: bool = True,
        cuda_graphs: bool = True,
        compile: bool = False,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
        sample_special_tokens: bool = False,
        prefix_cache_tokens: int = 16384,
        record_routes: bool = False,
    ) -> None:
        if dtype != "auto" and dtype not in DTYPES:
            raise ConfigError(f"--engine.dtype {dtype!r}: valid choices: auto, {', '.join(DTYPES)}")
        if isinstance(prefix_cache_tokens, bool) or not isinstance(prefix_cache_tokens, int) or prefix_cache_tokens < 0:
            raise ConfigError(f"--engine.prefix_cache_tokens {prefix_cache_tokens!r}: a number of tokens >= 0 "
                              "(0: no prefix cache)")
        if record_routes and use_generate:
            raise ConfigError("--engine.record_routes true needs the engine's own loop: use --engine.use_generate "
                              "false")
        self.record_routes = record_routes
        self.prefix_cache_tokens = prefix_cache_tokens
        self._prefix: PrefixCache | None = None
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.offload_when_asleep = offload_when_asleep
        self.use_generate = use_generate
        if use_generate:
            self.capabilities = EngineCapabilities(images=True, interrupt=False, routes=False)
        self.static_cache = static_cache
        self.cuda_graphs = cuda_graphs
        self.sample_special_tokens = sample_special_tokens
        if compile and (use_generate or not static_cache):
            raise ConfigError("--engine.compile true compiles the static-cache decoder's step: it needs "
                              "--engine.static_cache true and --engine.use_generate false")
        self.compile = compile
        self._decoder: StaticCacheDecoder | None = None
        self.model: PreTrainedModel | None = None
        self.device = torch.device("cpu")
        self.pad_id = 0
        self.eos_ids: tuple[int, ...] = ()
        self.bos_id: int | None = None
        self.media_ids: tuple[int, ...] = ()
        self.asleep = False

    def setup(self, source: ModelSource, device: torch.device) -> None:
        from transformers import GenerationConfig

        self.device = device
        self._decoder = None
        if self.compile:
            if device.type == "cuda" and self.cuda_graphs:
                raise ConfigError("--engine.compile true with --engine.cuda_graphs true on a GPU is untested (the CUDA "
                                  "graph already replays the step without launches): use one of them")
            check_compiler("--engine.compile", device)
        model = causal_lm_class(source).from_pretrained(
            source.path, dtype=source.dtype if self.dtype == "auto" else DTYPES[self.dtype],
            trust_remote_code=source.trust_remote_code,
        )
        _move(model, device)
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self._prefix = PrefixCache(self.prefix_cache_tokens) if self.prefix_cache_tokens else None
        self._prefix_checked = False  # the model's KV cache is one the prefix cache can take apart (``_prefill``)
        config = model.config
        generation = getattr(model, "generation_config", None) or GenerationConfig()
        eos = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        pad = generation.pad_token_id if generation.pad_token_id is not None else config.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.bos_id = generation.bos_token_id if generation.bos_token_id is not None else config.bos_token_id
        # an image or video placeholder in a response would ask the model for an image it was never given
        self.media_ids = tuple(i for i in (getattr(config, "image_token_id", None),
                                           getattr(config, "video_token_id", None)) if isinstance(i, int))
        warn_ignored_generation_values(logger, source.path, generation, "hf")

    def _banned(self, stop_ids: Sequence[int]) -> list[int]:
        """Token ids never sampled in a response: pad and bos, unless they end a response (none with
        ``sample_special_tokens``), and an image-text-to-text model's image and video placeholders."""
        special = () if self.sample_special_tokens else (self.pad_id, self.bos_id)
        return [t for t in dict.fromkeys((*special, *self.media_ids)) if t is not None and t not in stop_ids]

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 visual: Visual | None = None) -> list[list[Generation]]:
        """``params.n`` generations per prompt; ``visual``: each prompt's images (``Prompt.visual``), if any."""
        model = self.model
        if model is None:
            raise RuntimeError("HFEngine.generate called before setup")
        if visual is not None and self.use_generate and any(v is not None for v in visual):
            raise ConfigError("--engine.use_generate true does not take image prompts (yet); use the engine's own "
                              "loop, --engine.use_generate false")
        flat = [list(p) for p in prompts for _ in range(params.n)]
        flat_visual = [v for v in (visual or [None] * len(prompts)) for _ in range(params.n)]
        chunk = self.max_batch_size or len(flat)
        generations: list[Generation] = []
        if self._prefix is not None:
            self._prefix.new_call()
        for start in range(0, len(flat), chunk):
            if self.use_generate:
                generations.extend(self._generate(model, flat[start : start + chunk], params))
            else:
                generations.extend(self._sample(model, flat[start : start + chunk], params,
                                                flat_visual[start : start + chunk]))
        return [generations[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.inference_mode()
    def next_token_logprobs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[int],
                            visual: Visual | None = None) -> list[list[float]]:
        """One forward over the left-padded prompts (chunks of ``max_batch_size``); the float32 log-softmax
        of the last position's logits at ``candidates``. ``visual``: each prompt's images (image prompts), which the
        forward takes as ``generate``'s prefill does (with, for a Qwen2-VL-style model, its 3D positions)."""
        from gcore.vision import multimodal_positions

        model = self.model
        if model is None:
            raise RuntimeError("HFEngine.next_token_logprobs called before setup")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("next_token_logprobs needs a non-empty prompt")
        picked = torch.tensor(list(candidates), dtype=torch.long, device=self.device)
        chunk = self.max_batch_size or len(prompts)
        rows: list[list[float]] = []
        for start in range(0, len(prompts), chunk):
            input_ids, attention_mask = self._pad([list(p) for p in prompts[start : start + chunk]])
            input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # as each prompt alone
            images = list(visual[start : start + chunk]) if visual is not None else []
            inputs = {k: v.to(self.device) for k, v in concat_visual(images).items()}
            rope = multimodal_positions(model, input_ids, attention_mask, inputs) if inputs else None
            if rope is not None:
                position_ids = rope[0]
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False, logits_to_keep=1, **inputs).logits[:, -1]
            rows.extend(torch.log_softmax(logits.float(), dim=-1)[:, picked].tolist())
        return rows

    @torch.inference_mode()
    def token_logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                       temperature: float = 1.0) -> list[list[float]]:
        """One forward over the right-padded sequences (chunks of ``max_batch_size``), as the trainer's
        (``gcore/backends/torch/forward.py``): the float32 log-softmax of the logits divided by ``temperature``, at
        each token from ``starts[i]`` on."""
        model = self.model
        if model is None:
            raise RuntimeError("HFEngine.token_logprobs called before setup")
        if len(starts) != len(sequences):
            raise ValueError(f"token_logprobs: {len(starts)} starts for {len(sequences)} sequences")
        if any(not 1 <= start <= len(seq) for seq, start in zip(sequences, starts, strict=True)):
            raise ValueError("token_logprobs: each start must be >= 1 and within its sequence")
        chunk = self.max_batch_size or len(sequences) or 1
        rows: list[list[float]] = []
        for first in range(0, len(sequences), chunk):
            part = [list(seq) for seq in sequences[first : first + chunk]]
            input_ids, attention_mask = self._pad(part, right=True, min_width=2)
            input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
            logits = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=False).logits
            logits = logits.float()
            if temperature not in (0.0, 1.0):
                logits = logits / temperature
            chosen = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
            for row, seq in enumerate(part):
                start = starts[first + row]
                rows.append(chosen[row, start - 1 : len(seq) - 1].tolist())
        return rows

    def _pad(self, rows: list[list[int]], right: bool = False, min_width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` padded to one width (at least ``min_width``) with the pad id, on the left (prompts to continue) or
        on the ``right`` (sequences to score); and the attention mask of their tokens."""
        width = max(max(len(r) for r in rows), min_width)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, r in enumerate(rows):
            where = slice(0, len(r)) if right else slice(width - len(r), width)
            input_ids[i, where] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, where] = 1
        return input_ids, attention_mask

    def _static_decoder(self, model: PreTrainedModel) -> StaticCacheDecoder | None:
        """The static-cache decoder of the model, (re)built when missing or stale; ``None`` when the
        architecture has none (then decoding runs through the model's forward with a ``DynamicCache``)."""
        if not self.static_cache:
            return None
        if self._decoder is None or not self._decoder.is_current():
            with torch.inference_mode(False), torch.no_grad():  # the fused weights must stay writable by syncs
                self._decoder = StaticCacheDecoder.build(model)
        return self._decoder

    def _sample(self, model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams,
                visual: Visual = ()) -> list[Generation]:
        """Batched sampling: one prefill per distinct prompt, then one decode step and one draw per token."""
        stop_ids = tuple(dict.fromkeys(self.eos_ids + tuple(params.stop_token_ids)))
        if self.record_routes:
            return self._sample_recording(model, prompts, params, visual, stop_ids)
        prefill = self._prefill(model, prompts, visual)
        advance, decoder = self._decode_step(model, prefill, params.max_new_tokens)
        return self._decode(prefill.logits, advance, decoder, params, stop_ids)

    def _sample_recording(self, model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams,
                          visual: Visual, stop_ids: tuple[int, ...]) -> list[Generation]:
        """``_sample`` with the routers' choices recorded (``record_routes``): the prefill's for each prompt token it
        ran, then each decode step's for the token it took; ``Generation.routed_experts`` ``[P + R - 1, layers, k]``.
        The MoE models have no static-cache decoder: every decode step runs every row through the model's
        forward."""
        from gcore.moe import RouterTap, is_moe

        if not is_moe(model):
            raise ConfigError(f"--engine.record_routes true: {type(model).__name__} is not a mixture of experts (no "
                              "top-k router); use an MoE model (--model.architecture qwen3_moe), or leave it false")
        with RouterTap(model) as tap:
            prefill = self._prefill(model, prompts, visual)
            layers = len(tap.routers)
            distinct = prefill.attention_mask.shape[0]
            width_in = tap.calls[0][2].shape[0] // distinct  # the prefill's input width (its new tokens)
            prompt_routes = torch.stack([idx for _, _, idx in tap.calls[:layers]], dim=1).reshape(
                distinct, width_in, layers, tap.top_k).cpu()
            ran = prefill.attention_mask[:, -width_in:].sum(-1).cpu().tolist()  # each prompt's tokens it ran
            tap.reset()
            advance, decoder = self._decode_step(model, prefill, params.max_new_tokens)
            if decoder is not None:
                raise ConfigError(f"--engine.record_routes true: {type(model).__name__} decodes with the static-cache "
                                  "decoder, which has no routers: not a mixture of experts")
            generations = self._decode(prefill.logits, advance, decoder, params, stop_ids)
            steps = len(tap.calls) // layers
            decoded = (torch.stack([idx for _, _, idx in tap.calls[: steps * layers]]).reshape(
                steps, layers, len(prompts), tap.top_k).permute(2, 0, 1, 3).cpu() if steps else None)
        rows = prefill.rows.cpu().tolist()
        for row, generation in enumerate(generations):
            prompt = torch.full((len(prompts[row]), layers, tap.top_k), -1, dtype=torch.int16)
            count = min(ran[rows[row]], len(prompts[row]))
            if count:
                prompt[-count:] = prompt_routes[rows[row], width_in - count:].to(torch.int16)
            fed = len(generation.token_ids) - 1  # the last sampled token is never run
            tokens = decoded[row, :fed].to(torch.int16) if decoded is not None and fed > 0 else prompt[:0]
            generation.routed_experts = torch.cat([prompt, tokens])
        return generations

    def _prefill(self, model: PreTrainedModel, prompts: list[list[int]], visual: Visual) -> _Prefill:
        """One forward over the distinct prompts (a prompt is its tokens and its images: the image tokens of two
        images of one size are the same), left-padded, into a ``DynamicCache``."""
        from transformers import DynamicCache

        from gcore.vision import multimodal_positions

        device = self.device
        images = list(visual) or [None] * len(prompts)
        keys = [(tuple(p), id(v)) for p, v in zip(prompts, images, strict=True)]
        distinct = {key: i for i, key in enumerate(dict.fromkeys(keys))}
        rows = torch.tensor([distinct[key] for key in keys], dtype=torch.long, device=device)
        firsts = {key: row for row, key in reversed(list(enumerate(keys)))}
        texts = [list(key[0]) for key in distinct]
        inputs = {k: v.to(device) for k, v in concat_visual([images[firsts[key]] for key in distinct]).items()}
        prefix = self._prefix if not inputs else None  # image prompts bypass the prefix cache
        hits = [prefix.longest(tuple(p)) for p in texts] if prefix is not None else []
        if any(length for length, _ in hits):  # the cached prefixes' KV, then each prompt's new tokens after it
            input_ids, attention_mask, position_ids, cache = self._after_prefixes(model, texts, hits)
        else:
            input_ids, attention_mask = self._pad(texts)
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            # positions count real tokens only, so a left-padded row sees the positions it would see alone
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache(config=model.config)
        rope = multimodal_positions(model, input_ids, attention_mask, inputs) if inputs else None
        if rope is not None:  # M-RoPE: 3D positions over the images; a text token ``t`` is at ``t + delta``
            position_ids, deltas = rope
        with_cache = {cache_keyword(model): cache}
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=True, logits_to_keep=1, **inputs, **with_cache,
        ).logits[:, -1][rows]
        if prefix is not None:
            prefilled = int(attention_mask[:, -input_ids.shape[1]:].sum())
            prefix.stats.prefilled_tokens += prefilled
            logger.debug("prefix cache: %d prompt tokens reused, %d prefilled, over %d distinct prompts",
                         sum(length for length, _ in hits), prefilled, len(texts))
            self._keep_prefixes(prefix, texts, cache, attention_mask)
        prompt_lengths = attention_mask.sum(-1)[rows]
        if rope is not None:
            prompt_lengths = prompt_lengths + deltas[rows, 0].to(device)
        return _Prefill(rows, attention_mask, cache, with_cache, logits, prompt_lengths, bool(inputs),
                        rope is not None)

    def _after_prefixes(self, model: PreTrainedModel, prompts: list[list[int]], hits: list[tuple[int, LayerKV | None]],
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache]:
        """The prefill's inputs where some prompts have a cached prefix: a ``DynamicCache`` holding each prompt's
        cached KV (left-padded to the longest cached prefix), and each prompt's remaining tokens (left-padded) as the
        input ids. The attention mask covers both (0 on both paddings, so a row may have a gap between its prefix
        and its new tokens), and the positions count real tokens only: each row sees what it would see alone."""
        from transformers import DynamicCache

        device = self.device
        past = max(length for length, _ in hits)
        suffixes = [p[length:] for p, (length, _) in zip(prompts, hits, strict=True)]
        input_ids, suffix_mask = self._pad(suffixes)
        attention_mask = torch.cat((torch.zeros((len(prompts), past), dtype=torch.long), suffix_mask), dim=1)
        for row, (length, _) in enumerate(hits):
            attention_mask[row, past - length : past] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        reference = next(kv for _, kv in hits if kv is not None)
        cache = DynamicCache(config=model.config)
        for index, (ref_keys, ref_values) in enumerate(reference):
            keys = ref_keys.new_zeros((len(prompts), ref_keys.shape[0], past, ref_keys.shape[2]))
            values = ref_values.new_zeros((len(prompts), ref_values.shape[0], past, ref_values.shape[2]))
            for row, (length, kv) in enumerate(hits):
                if kv is not None and length:
                    keys[row, :, past - length :] = kv[index][0][:, :length]
                    values[row, :, past - length :] = kv[index][1][:, :length]
            cache.update(keys, values, index)
        return input_ids, attention_mask, position_ids, cache

    def _keep_prefixes(self, prefix: PrefixCache, prompts: list[list[int]], cache: DynamicCache,
                       attention_mask: torch.Tensor) -> None:
        """Keep each prompt's KV from the prefill's ``cache`` in the prefix cache. The first time, check that the
        model's cache is one whose layers hold plain full-attention keys and values (``DynamicLayer``); else the
        prefix cache is turned off for this engine, with a line in the log."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if not self._prefix_checked:
            keys = [getattr(layer, "keys", None) for layer in layers or ()]
            if not layers or any(type(layer) is not DynamicLayer for layer in layers) or any(
                    not isinstance(k, torch.Tensor) or k.dim() != 4 for k in keys):
                logger.info("--engine.prefix_cache_tokens: %s's KV cache is not one of full-attention layers only: "
                            "no prefix cache", type(self.model).__name__)
                self._prefix = None
                return
            self._prefix_checked = True
        assert layers is not None  # checked above
        for row, prompt in enumerate(prompts):
            real = attention_mask[row].nonzero().squeeze(-1)

            def kv(row: int = row, real: torch.Tensor = real) -> LayerKV:
                return [(layer.keys[row].index_select(1, real), layer.values[row].index_select(1, real))
                        for layer in layers]

            prefix.put(tuple(prompt), kv)

    @property
    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's counts since ``setup`` (``PrefixStats``; all 0 when off) and the tokens it holds."""
        if self._prefix is None:
            return {**PrefixStats().as_dict(), "held_tokens": 0}
        return {**self._prefix.stats.as_dict(), "held_tokens": self._prefix.tokens}

    def _decode_step(self, model: PreTrainedModel, prefill: _Prefill,
                     budget: int) -> tuple[Advance, StaticCacheDecoder | None]:
        """The decode step after ``prefill``: the static-cache decoder's (text prompts, where the architecture has
        one), else the model's forward on the prefill's ``DynamicCache``; and that decoder, if any."""
        device, rows, attention_mask = self.device, prefill.rows, prefill.attention_mask
        width, prompt_lengths = attention_mask.shape[1], prefill.prompt_lengths
        decoder = self._static_decoder(model) if not prefill.images else None
        if decoder is not None:
            decoder.start(prefill.cache, rows, attention_mask, budget)
            if self.cuda_graphs and device.type == "cuda":
                step = decoder.graphed_step()
            else:
                step = decoder.compiled_step() if self.compile else decoder.step

            def advance(chosen: torch.Tensor, t: int, active: torch.Tensor) -> torch.Tensor:
                return step(chosen, prompt_lengths[active] + t, width + t)

            return advance, decoder
        prefill.cache.reorder_cache(cast("torch.LongTensor", rows))  # int64 row indices
        mask = torch.ones((len(rows), width + budget), dtype=attention_mask.dtype, device=device)
        mask[:, :width] = attention_mask[rows]
        rope, with_cache = prefill.rope, prefill.with_cache

        def forward(chosen: torch.Tensor, t: int, active: torch.Tensor) -> torch.Tensor:
            positions = (prompt_lengths + t).unsqueeze(-1)
            if rope:
                positions = positions.unsqueeze(0).expand(3, -1, -1)
            return model(
                input_ids=chosen.unsqueeze(-1), attention_mask=mask[:, : width + t + 1],
                position_ids=positions, use_cache=True, logits_to_keep=1, **with_cache,
            ).logits[:, -1]

        return forward, None

    def _draw(self, logits: torch.Tensor, params: SamplingParams, banned: torch.Tensor, batch: int,
              active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each decoded row (``active``, of ``batch``): the chosen ids and the log-probabilities of
        the model's own distribution (at the temperature) they were drawn from; ``banned`` ids are never drawn."""
        logits = logits.float()
        greedy = params.temperature == 0
        if not greedy and params.temperature != 1.0:
            logits = logits / params.temperature
        logp = torch.log_softmax(logits, dim=-1)
        allowed = logp.index_fill(-1, banned, float("-inf")) if len(banned) else logp
        if greedy:
            return allowed.argmax(-1), logp
        # a number for every row, decoded or not: the random stream does not depend on the compaction
        uniform = torch.rand((batch, 1), device=self.device, dtype=torch.float32)[active]
        return _sample_rows(_truncate(allowed, params.top_k, params.top_p).exp(), uniform), logp

    def _decode(self, logits: torch.Tensor, advance: Advance, decoder: StaticCacheDecoder | None,
                params: SamplingParams, stop_ids: tuple[int, ...]) -> list[Generation]:
        """Draw and decode token after token from the prefill's ``logits`` until every row stopped, the budget is
        spent or ``interrupt`` says so."""
        device, batch, budget = self.device, logits.shape[0], params.max_new_tokens
        stop = torch.tensor(stop_ids, dtype=torch.long, device=device) if stop_ids else None
        banned = torch.tensor(self._banned(stop_ids), dtype=torch.long, device=device)
        # rows that finished (at a stop token) leave the decode batch (``StaticCacheDecoder.keep``) once half of those
        # decoded have: on CPU a finished row costs a decode step's matmuls as much as a live one (not under compile
        # or CUDA graphs, whose shapes are fixed)
        compact = decoder is not None and stop is not None and device.type == "cpu" and not self.compile
        tokens = torch.full((batch, budget), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, budget), dtype=torch.float32, device=device)
        lengths = torch.full((batch,), budget, dtype=torch.long, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        active = torch.arange(batch, device=device)  # the rows decoded: ``logits``' rows
        # reading ``done`` waits for the device: on a GPU look every 8 tokens so that launches run ahead
        check_every = 1 if device.type == "cpu" else 8
        interrupt = self.interrupt
        for t in range(budget):
            chosen, logp = self._draw(logits, params, banned, batch, active)
            was_done = done[active]
            chosen = torch.where(was_done, self.pad_id, chosen)
            tokens[active, t] = chosen
            logprobs[active, t] = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            if stop is not None:
                hit = ~was_done & torch.isin(chosen, stop)
                lengths[active] = torch.where(hit, t + 1, lengths[active])  # keep the stop token: it learns to stop
                done[active] = was_done | hit
                if (t + 1) % check_every == 0 and bool(done.all()):
                    break
            if interrupt is not None and t + 1 < budget and interrupt():  # a weight update came: stop here
                lengths = torch.where(done, lengths, t + 1)
                break
            if t + 1 < budget:
                live = ~done[active]
                if compact and 2 * int(live.sum()) <= len(active):
                    keep = live.nonzero().squeeze(-1)
                    assert decoder is not None  # ``compact`` says so
                    decoder.keep(keep)
                    active, chosen = active[keep], chosen[keep]
                logits = advance(chosen, t, active)
        finished = done.cpu().tolist() if stop is not None else [False] * batch
        tokens, logprobs, kept = tokens.cpu(), logprobs.cpu(), lengths.cpu().tolist()
        return [
            Generation(tokens[row, : kept[row]].tolist(), logprobs[row, : kept[row]].tolist(), finished[row])
            for row in range(batch)
        ]

    def _generate(self, model: PreTrainedModel, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        input_ids, attention_mask = self._pad(prompts)
        width = input_ids.shape[1]
        stop_ids = tuple(dict.fromkeys(self.eos_ids + tuple(params.stop_token_ids)))
        greedy = params.temperature == 0
        out = cast("GenerationMixin", model).generate(  # AutoModelForCausalLM's models are GenerationMixins
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=params.top_p if params.top_p < 1.0 else None,
            top_k=params.top_k if params.top_k > 0 else None,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=list(stop_ids) or None,
            pad_token_id=self.pad_id,
            suppress_tokens=self._banned(stop_ids) or None,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new_tokens = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # raw logits, before sampling processors
        if not greedy:
            logits = logits / params.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results = []
        stop = torch.tensor(stop_ids, dtype=torch.long) if stop_ids else None
        for row in range(len(prompts)):
            tokens = new_tokens[row]
            length, finished = tokens.shape[0], False
            if stop is not None:
                hits = torch.isin(tokens, stop).nonzero()
                if len(hits):
                    length, finished = int(hits[0]) + 1, True  # keep the stop token: the policy learns to stop
            results.append(Generation(tokens[:length].tolist(), logprobs[row, :length].tolist(), finished))
        return results

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.model is None:
            raise RuntimeError("HFEngine.update_weights called before setup")
        if self._prefix is not None:  # KV computed with the old weights is never reused
            self._prefix.clear()
        own = self.model.state_dict()
        received = 0
        for name, tensor in weights:
            if name not in own:
                raise ConfigError(f"weight sync: the engine's model has no parameter named {name!r}")
            target = own[name]
            if target.shape != tensor.shape:
                raise ConfigError(
                    f"weight sync: shape mismatch for {name!r}: engine {tuple(target.shape)}, "
                    f"trainer {tuple(tensor.shape)}"
                )
            target.copy_(tensor)
            received += tensor.numel() * tensor.element_size()
        return received

    def sleep(self) -> None:
        if self._prefix is not None:
            self._prefix.clear()
        if self.model is not None and self.offload_when_asleep and self.device.type != "cpu" and not self.asleep:
            self._decoder = None  # its KV buffers and CUDA graph; moving the weights makes it stale anyway
            _move(self.model, torch.device("cpu"))
            torch.cuda.empty_cache()
            self.asleep = True

    def wake_up(self) -> None:
        if self.model is not None and self.asleep:
            _move(self.model, self.device)
            self.asleep = False

    def shutdown(self) -> None:
        self.model = None
        self._decoder = None
        self._prefix = None


def _move(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to(device)`` (in place). Typed as a torch ``Module``'s: transformers' stub of ``PreTrainedModel.to``
    (a ``functools.wraps`` of ``Module.to``) asks for ``self`` again; the call still runs ``PreTrainedModel.to``."""
    model.to(device)


def _sample_rows(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row, drawn with the row's (unnormalised) probabilities and its number ``uniform`` ``[B, 1]`` in
    [0, 1).

    Inverse-CDF sampling: one uniform number per row and a binary search in the cumulative sums.
    On CPU this is several times cheaper than ``torch.multinomial``, which draws one exponential
    variate per vocabulary entry. An entry of probability 0 is never drawn (its cumulative sum
    equals its predecessor's, and the search returns the first entry whose sum exceeds ``u``).
    """
    cdf = probs.cumsum(-1)
    u = uniform.to(cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def _truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities with everything outside the top-k / nucleus set to -inf (for sampling only).

    As ``model.generate``'s warpers: top-k first, then top-p over the mass of what is left (the top-k and the
    tokens not banned), renormalised; top-p over the whole distribution's mass would keep more tokens."""
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        probs = torch.softmax(sorted_logp, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix whose mass reaches top_p
        logp = logp.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logp


@dataclass
class _Prefill:
    """What ``HFEngine._prefill`` hands the decode: row ``i`` of the batch continues distinct prompt ``rows[i]``."""

    rows: torch.Tensor  # [batch]: each row's distinct prompt
    attention_mask: torch.Tensor  # [distinct prompts, width]: left padding 0
    cache: DynamicCache  # the distinct prompts' keys and values
    with_cache: dict[str, Any]  # the cache as the model's forward takes it (``cache_keyword``)
    logits: torch.Tensor  # [batch, vocab]: each row's first next-token logits
    prompt_lengths: torch.Tensor  # [batch]: the position of each row's first response token
    images: bool  # the prompts have images (the decode goes through the model's forward)
    rope: bool  # 3D positions (M-RoPE: a Qwen2-VL-style model with images)
