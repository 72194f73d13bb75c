"""``hf`` engine: a transformers model sampled in the controller's own process.

By default it samples with its own loop (one forward with a KV cache and one sampling step per
token, for the whole batch at once) instead of ``model.generate``: on CPU, ``generate``'s
per-token machinery (logits processors, stopping criteria, output bookkeeping) costs as much as
the tiny model's forward. ``use_generate=True`` goes back to ``model.generate``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from gcore.engines.base import Engine
from gcore.errors import ConfigError
from gcore.types import Generation, SamplingParams


class HFEngine(Engine):
    """Samples with ``transformers`` in-process; the CPU default and the reference engine.

    Args:
        max_batch_size: split generation into chunks of at most this many sequences (0: no limit).
        offload_when_asleep: on ``sleep`` move the weights to CPU memory (only useful on GPUs).
        use_generate: sample with ``model.generate`` instead of the engine's own loop (for models
            whose forward does not take ``past_key_values``/``position_ids`` the standard way).
    """

    def __init__(self, max_batch_size: int = 0, offload_when_asleep: bool = True, use_generate: bool = False) -> None:
        self.max_batch_size = max_batch_size
        self.offload_when_asleep = offload_when_asleep
        self.use_generate = use_generate
        self.model: torch.nn.Module | None = None
        self.device = torch.device("cpu")
        self.pad_id = 0
        self.eos_ids: tuple[int, ...] = ()
        self.asleep = False

    def setup(self, model_path: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=trust_remote_code
        ).to(device)
        self.model.eval()
        self.model.requires_grad_(False)
        config = self.model.config
        generation = getattr(self.model, "generation_config", None) or GenerationConfig()
        eos = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        pad = generation.pad_token_id if generation.pad_token_id is not None else config.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        if self.model is None:
            raise RuntimeError("HFEngine.generate called before setup")
        flat = [list(p) for p in prompts for _ in range(params.n)]
        chunk = self.max_batch_size or len(flat)
        generations: list[Generation] = []
        sample = self._generate if self.use_generate else self._sample
        for start in range(0, len(flat), chunk):
            generations.extend(sample(flat[start : start + chunk], params))
        return [generations[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[row, width - len(p) :] = 1
        return input_ids, attention_mask

    def _sample(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Batched sampling: one prefill, then one cached forward and one sampling step per token."""
        from transformers import DynamicCache

        model, device = self.model, self.device
        input_ids, attention_mask = self._left_pad(prompts)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        batch, budget = input_ids.shape[0], params.max_new_tokens
        stop_ids = tuple(dict.fromkeys(self.eos_ids + tuple(params.stop_token_ids)))
        stop = torch.tensor(stop_ids, dtype=torch.long, device=device) if stop_ids else None
        greedy = params.temperature == 0
        # positions count real tokens only, so a left-padded row sees the positions it would see alone
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        tokens = torch.full((batch, budget), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, budget), dtype=torch.float32, device=device)
        lengths = torch.full((batch,), budget, dtype=torch.long, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        mask = torch.ones((batch, input_ids.shape[1] + budget), dtype=attention_mask.dtype, device=device)
        mask[:, : input_ids.shape[1]] = attention_mask
        cache = DynamicCache(config=model.config)
        next_input, next_position, width = input_ids, position_ids, input_ids.shape[1]
        for t in range(budget):
            logits = model(
                input_ids=next_input,
                attention_mask=mask[:, :width],
                position_ids=next_position,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1].float()
            if not greedy and params.temperature != 1.0:
                logits = logits / params.temperature
            logp = torch.log_softmax(logits, dim=-1)
            if greedy:
                chosen = logp.argmax(-1)
            else:
                chosen = _sample_rows(_truncate(logp, params.top_k, params.top_p).exp())
            chosen = torch.where(done, self.pad_id, chosen)
            tokens[:, t] = chosen
            logprobs[:, t] = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            if stop is not None:
                hit = ~done & torch.isin(chosen, stop)
                lengths = torch.where(hit, t + 1, lengths)  # keep the stop token: the policy learns to stop
                done = done | hit
                if t + 1 == budget or bool(done.all()):
                    break
            next_input, next_position, width = chosen.unsqueeze(-1), next_position[:, -1:] + 1, width + 1
        finished = done.cpu().tolist() if stop is not None else [False] * batch
        tokens, logprobs, lengths = tokens.cpu(), logprobs.cpu(), lengths.cpu().tolist()
        return [
            Generation(tokens[row, : lengths[row]].tolist(), logprobs[row, : lengths[row]].tolist(), finished[row])
            for row in range(batch)
        ]

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        input_ids, attention_mask = self._left_pad(prompts)
        width = input_ids.shape[1]
        stop_ids = tuple(dict.fromkeys(self.eos_ids + tuple(params.stop_token_ids)))
        greedy = params.temperature == 0
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=params.top_p if params.top_p < 1.0 else None,
            top_k=params.top_k if params.top_k > 0 else None,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=list(stop_ids) or None,
            pad_token_id=self.pad_id,
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
        if self.model is not None and self.offload_when_asleep and self.device.type != "cpu" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.asleep = True

    def wake_up(self) -> None:
        if self.model is not None and self.asleep:
            self.model.to(self.device)
            self.asleep = False

    def shutdown(self) -> None:
        self.model = None


def _sample_rows(probs: torch.Tensor) -> torch.Tensor:
    """One index per row, drawn with the row's (unnormalised) probabilities.

    Inverse-CDF sampling: one uniform number per row and a binary search in the cumulative sums.
    On CPU this is several times cheaper than ``torch.multinomial``, which draws one exponential
    variate per vocabulary entry. An entry of probability 0 is never drawn (its cumulative sum
    equals its predecessor's, and the search returns the first entry whose sum exceeds ``u``).
    """
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def _truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities with everything outside the top-k / nucleus set to -inf (for sampling only)."""
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        cumulative = sorted_logp.exp().cumsum(-1)
        drop = cumulative - sorted_logp.exp() >= top_p  # keep the smallest prefix whose mass reaches top_p
        logp = logp.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logp
