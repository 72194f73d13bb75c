"""LoRA adapters for the ``torch`` backend (``--backend.lora_rank``), through the ``peft`` library.

The adapters are injected into the HF model in place (``peft.inject_adapter_in_model``): each targeted
``nn.Linear`` becomes a LoRA layer holding the frozen base weight ``W`` (``base_layer``) and the trained
low-rank factors ``A`` and ``B``; only those factors require gradients. Everything outside this module
(engines, checkpoints of the HF format) keeps seeing base-model parameter names with the merged weight
``W + (alpha / rank) * B @ A``:

- ``merged_weights`` gives the engine sync the weights LoRA changes, merged, under the base names. It
  sends every ``nn.Linear`` that shares a parent module with a LoRA layer (for ``q_proj`` also ``k_proj``,
  ``v_proj`` and ``o_proj``): engines that fuse sibling projections into one tensor (vLLM's ``qkv_proj`` and
  ``gate_up_proj``) then always receive whole fused tensors. Every other parameter is frozen and equals the
  checkpoint the engines loaded at start, so a partial update leaves them exact.
- ``merged_state_dict`` is the whole model as a plain HF state dict (for ``save_pretrained``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from gcore.errors import ConfigError
from gcore.vision import VISION_MODULES

ADAPTER = "default"


def check_options(rank: int, alpha: int | None, target_modules: Sequence[str] | None) -> None:
    """One-line ``ConfigError`` for option values that no model accepts."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"--backend.lora_rank {rank!r}: must be an integer >= 0 (0: no LoRA, full fine-tuning)")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int) or alpha <= 0):
        raise ConfigError(f"--backend.lora_alpha {alpha!r}: must be an integer > 0 (or unset: 2 x lora_rank)")
    if target_modules is not None and (isinstance(target_modules, str) or not target_modules
                                       or not all(isinstance(t, str) and t for t in target_modules)):
        raise ConfigError(f"--backend.lora_target_modules {target_modules!r}: must be a non-empty list of module "
                          "names (e.g. [q_proj, v_proj]), or unset for every linear layer but the output head")


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The qualified names of the model's ``nn.Linear`` modules, without the output head (LM head)."""
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head]


def add_adapters(model: torch.nn.Module, rank: int, alpha: int | None,
                 target_modules: Sequence[str] | None) -> list[str]:
    """Inject LoRA layers of ``rank`` into ``model`` in place and freeze everything else. ``target_modules``:
    module names matched against the end of each linear layer's qualified name (``q_proj`` matches
    ``model.layers.0.self_attn.q_proj``); ``None``: every linear layer but the output head and, in an
    image-text-to-text model, but those of the vision encoder and its projector (LoRA on the language part; the
    vision part stays frozen). Returns the names of the linear modules the engine sync sends (``merged_weights``)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:
        raise ConfigError(f"--backend.lora_rank {rank} needs the peft package: pip install 'gcore[lora]'") from err

    linears = linear_module_names(model)
    short = sorted({name.rsplit(".", 1)[-1] for name in linears})
    language = [name for name in linears if not set(name.split(".")) & set(VISION_MODULES)]
    if target_modules is not None:
        targets = list(target_modules)
    else:  # by full name where a vision encoder's linear layers share the language part's short names
        targets = short if len(language) == len(linears) else language
    if target_modules is not None:
        for target in targets:
            if not any(name == target or name.endswith("." + target) for name in linears):
                raise ConfigError(f"--backend.lora_target_modules: {target!r} matches no linear module of the "
                                  f"model; its linear modules: {', '.join(short)}")
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=0.0,
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    adapted = {name for name, _ in lora_layers(model)}
    parents = {name.rsplit(".", 1)[0] for name in adapted}
    return [name for name, _ in model.named_modules()
            if name in adapted or (name in linears and name.rsplit(".", 1)[0] in parents)]


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """The model's LoRA layers (``peft.tuners.lora.LoraLayer``) with their qualified names."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@torch.no_grad()
def _merged(module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:  # noqa: ANN401  a Linear or a LoraLayer
    """A linear module's weight (merged ``W + scale * B @ A`` for a LoRA layer) and bias."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    weight = base.weight.detach() + module.get_delta_weight(ADAPTER).to(base.weight.dtype)
    return weight, None if base.bias is None else base.bias.detach()


def merged_weights(model: torch.nn.Module, module_names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights (and biases) of ``module_names`` under base-model names, LoRA layers merged."""
    modules = dict(model.named_modules())
    for name in module_names:
        weight, bias = _merged(modules[name])
        yield f"{name}.weight", weight
        if bias is not None:
            yield f"{name}.bias", bias


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model as a plain HF state dict: LoRA layers merged, adapter tensors left out."""
    merged = {f"{name}.weight": _merged(module)[0] for name, module in lora_layers(model)}
    out = {}
    for key, tensor in model.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        out[key] = merged.get(key, tensor)
    return out
