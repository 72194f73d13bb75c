"""``hf`` engine: transformers ``generate`` in the controller's own process."""

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
    """

    def __init__(self, max_batch_size: int = 0, offload_when_asleep: bool = True) -> None:
        self.max_batch_size = max_batch_size
        self.offload_when_asleep = offload_when_asleep
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

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        if self.model is None:
            raise RuntimeError("HFEngine.generate called before setup")
        flat = [list(p) for p in prompts for _ in range(params.n)]
        chunk = self.max_batch_size or len(flat)
        generations: list[Generation] = []
        for start in range(0, len(flat), chunk):
            generations.extend(self._generate(flat[start : start + chunk], params))
        return [generations[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):  # left padding
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[row, width - len(p) :] = 1
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
