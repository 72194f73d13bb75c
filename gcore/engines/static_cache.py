"""The ``hf`` engine's static-cache decoder: one decode step of a Llama-style model (``llama``, ``qwen2``) written
against the model's own weights, with a preallocated KV cache, optionally captured as a CUDA graph or compiled.

``HFEngine`` builds it (``StaticCacheDecoder.build``) where the architecture allows and decodes through the model's
forward with a growing ``DynamicCache`` elsewhere. Imported as ``gcore.engines.hf.StaticCacheDecoder`` too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel
    from transformers.cache_utils import DynamicLayer


class StaticCacheDecoder:
    """One decode step of a Llama-style model (``llama``, ``qwen2``) written against the model's own
    weights, with a preallocated KV cache: no per-token cache growth, masks or module dispatch.

    The query/key/value and gate/up projections run as one matmul each: at build time their weights
    are copied into one fused tensor per layer and the model's parameters become views into it, so
    the HF modules (prefill, ``update_weights``, ``state_dict``) and the decoder share one storage.
    """

    MODEL_TYPES = ("llama", "qwen2")
    ROPE_TYPES = ("default", "linear", "llama3")  # tables that do not depend on the sequence length

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        # the HF modules are reached by name (torch types a submodule attribute as ``Tensor | Module``); ``build``
        # checked what the decoder relies on
        hf: Any = model
        base = hf.model
        self.embed: torch.nn.Embedding = base.embed_tokens
        self.norm: _RMSNorm = base.norm
        self.lm_head: torch.nn.Linear = hf.lm_head
        self.rotary: torch.nn.Module = base.rotary_emb
        self.layers = [_FusedLayer(layer) for layer in base.layers]
        attention = base.layers[0].self_attn
        self.head_dim: int = attention.head_dim
        self.heads: int = model.config.num_attention_heads
        self.kv_heads: int = model.config.num_key_value_heads
        self.scaling: float = attention.scaling
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.shape: tuple[int, ...] = ()
        self._graph: _CudaGraphStep | None = None
        self._compiled: Callable[..., torch.Tensor] | None = None  # ``step`` under torch.compile, made once

    @classmethod
    def build(cls, model: PreTrainedModel) -> StaticCacheDecoder | None:
        """The decoder for ``model``, or ``None`` when its architecture is not one this class implements."""
        config = model.config
        base = getattr(model, "model", None)
        if getattr(config, "model_type", None) not in cls.MODEL_TYPES or base is None:
            return None
        if getattr(config, "hidden_act", None) != "silu" or getattr(config, "use_sliding_window", False):
            return None
        if getattr(getattr(base, "rotary_emb", None), "rope_type", None) not in cls.ROPE_TYPES:
            return None
        for layer in base.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if any(not isinstance(getattr(attention, n, None), torch.nn.Linear)
                   for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
                return None
            if any(not isinstance(getattr(mlp, n, None), torch.nn.Linear)
                   for n in ("gate_proj", "up_proj", "down_proj")):
                return None
            if (getattr(attention, "sliding_window", None)
                    or getattr(layer, "attention_type", "full_attention") != "full_attention"):
                return None
        return cls(model)

    def is_current(self) -> bool:
        """Whether the model's parameters are still views into the fused tensors (``model.to`` breaks that)."""
        return all(layer.is_current() for layer in self.layers)

    def start(self, cache: DynamicCache, rows: torch.Tensor, mask: torch.Tensor, budget: int) -> None:
        """Copy the prefill's ``DynamicCache`` (one row per distinct prompt) into static buffers of
        ``prompt width + budget`` positions, row ``i`` taking prompt ``rows[i]``. Buffers of the same
        shape as the last call's are reused (a captured CUDA graph reads them where they are)."""
        batch, width = len(rows), mask.shape[1]
        shape = (batch, self.kv_heads, width + budget, self.head_dim)
        reference, _ = _prefilled(cache, 0)
        if self.shape != shape or self.keys[0].dtype != reference.dtype or self.keys[0].device != reference.device:
            self._graph = None
            self.shape = shape
            # zeros, not empty: the fixed-shape step multiplies masked slots by 0, and 0 * NaN is NaN
            self.keys = [reference.new_zeros(shape) for _ in self.layers]
            self.values = [reference.new_zeros(shape) for _ in self.layers]
            self.bias = reference.new_zeros((batch, 1, 1, width + budget))
            self.slots = torch.arange(width + budget, device=mask.device)
            self.cos = reference.new_zeros((width + budget, self.head_dim))
            self.sin = reference.new_zeros((width + budget, self.head_dim))
        for index, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            prefilled_keys, prefilled_values = _prefilled(cache, index)
            keys[:, :, :width] = prefilled_keys[rows]
            values[:, :, :width] = prefilled_values[rows]
        # additive attention bias: -inf on the left padding of each prompt
        self.bias.zero_()
        self.bias[:, 0, 0, :width].masked_fill_(mask[rows] == 0, float("-inf"))
        cos, sin = self.rotary(self.keys[0], self.slots.unsqueeze(0))
        half = self.head_dim // 2
        self.cos.copy_(cos[0])
        self.sin.copy_(torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1))  # rotate_half's sign folded in

    def keep(self, rows: torch.Tensor) -> None:
        """Go on with ``rows`` only (indices into the rows decoded so far, in order): their keys, values and
        padding bias move to the first ``len(rows)`` rows of the buffers, and the next steps decode that many."""
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[: len(rows)] = keys[rows]
            values[: len(rows)] = values[rows]
        self.bias[: len(rows)] = self.bias[rows]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        """Logits ``[B, vocab]`` after feeding ``tokens`` ``[B]`` at ``positions`` into cache slot ``slot``.

        With ``slot`` an ``int`` the step attends to slots ``0..slot`` only. With ``slot`` a one-element
        tensor every shape is fixed (the whole cache is attended, later slots masked), so that the step can
        be captured once as a CUDA graph (``graphed_step``) and replayed for every token."""
        batch, heads, kv_heads, dim = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, D]
        if isinstance(slot, int):  # the first ``batch`` rows of the buffers: fewer after ``keep``
            bias, seen = self.bias[:batch, ..., : slot + 1], slot + 1
        else:
            bias, seen = self.bias[:batch].masked_fill(self.slots > slot, float("-inf")), self.bias.shape[-1]
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        hidden = self.embed(tokens)
        for layer, all_keys, all_values in zip(self.layers, self.keys, self.values, strict=False):
            keys, values = all_keys[:batch], all_values[:batch]
            x = torch.nn.functional.rms_norm(hidden, layer.norm1.weight.shape, layer.norm1.weight, layer.eps1)
            qkv = torch.nn.functional.linear(x, layer.qkv_weight, layer.qkv_bias)
            q = qkv[:, :q_end].view(batch, heads, dim)
            k = qkv[:, q_end:k_end].view(batch, kv_heads, dim)
            q = q * cos + q.roll(dim // 2, -1) * sin
            k = k * cos + k.roll(dim // 2, -1) * sin
            v = qkv[:, k_end:].view(batch, kv_heads, dim)
            if isinstance(slot, int):
                keys[:, :, slot], values[:, :, slot] = k, v
            else:
                keys.index_copy_(2, slot, k.unsqueeze(2))
                values.index_copy_(2, slot, v.unsqueeze(2))
            scores = torch.matmul(q.view(batch, kv_heads, heads // kv_heads, dim),
                                  keys[:, :, :seen].transpose(-1, -2))
            probs = torch.softmax(scores * self.scaling + bias, dim=-1, dtype=torch.float32).to(q.dtype)
            attended = torch.matmul(probs, values[:, :, :seen]).view(batch, heads * dim)
            hidden = hidden + layer.o_proj(attended)
            x = torch.nn.functional.rms_norm(hidden, layer.norm2.weight.shape, layer.norm2.weight, layer.eps2)
            gate_up = torch.nn.functional.linear(x, layer.gate_up_weight, layer.gate_up_bias)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = hidden + layer.down_proj(torch.nn.functional.silu(gate) * up)
        hidden = torch.nn.functional.rms_norm(hidden, self.norm.weight.shape, self.norm.weight,
                                              self.norm.variance_epsilon)
        return self.lm_head(hidden)

    def compiled_step(self) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """``step`` through ``torch.compile``, in its fixed-shape form (the slot goes in as a one-element
        tensor, so that every token of a batch shape runs the same graph)."""
        if self._compiled is None:
            self._compiled = torch.compile(self.step)
        compiled = self._compiled

        def step(tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
            return compiled(tokens, positions, torch.tensor([slot], device=tokens.device))

        return step

    def graphed_step(self) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """``step`` for the buffers of the last ``start``, as a CUDA graph replay (captured on first use
        for each buffer shape). The returned logits live in the graph's output buffer: the next replay
        overwrites them."""
        if self._graph is None:
            self._graph = _CudaGraphStep(self)
        return self._graph


def _prefilled(cache: DynamicCache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values the prefill wrote into layer ``index`` of ``cache`` (``StaticCacheDecoder.build`` admits
    full-attention layers only: each a ``DynamicLayer``)."""
    layer = cast("DynamicLayer", cache.layers[index])
    if layer.keys is None or layer.values is None:
        raise RuntimeError(f"layer {index} of the prefill's KV cache holds no keys or values")
    return layer.keys, layer.values


class _RMSNorm(Protocol):
    """What the decoder reads of a Llama-style RMSNorm module."""

    weight: torch.nn.Parameter
    variance_epsilon: float


class _CudaGraphStep:
    """A decoder's fixed-shape step captured once as a CUDA graph; calling it copies the inputs into the
    graph's input buffers and replays it."""

    def __init__(self, decoder: StaticCacheDecoder) -> None:
        batch, device = decoder.shape[0], decoder.keys[0].device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        # warm-up and capture write into the last slot, which no real step reads unmasked
        self.slot = torch.full((1,), decoder.shape[2] - 1, dtype=torch.long, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: cuBLAS picks its kernels and workspaces outside the capture
                decoder.step(self.tokens, self.positions, self.slot)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decoder.step(self.tokens, self.positions, self.slot)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slot.fill_(slot)
        self.graph.replay()
        return self.logits


class _FusedLayer:
    """A decoder layer's weights, with q/k/v and gate/up fused (the module parameters become views)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        hf: Any = layer  # HF's decoder layer: its modules reached by name (``StaticCacheDecoder.build`` checked them)
        attention, mlp = hf.self_attn, hf.mlp
        self.norm1: _RMSNorm = hf.input_layernorm
        self.norm2: _RMSNorm = hf.post_attention_layernorm
        self.eps1, self.eps2 = self.norm1.variance_epsilon, self.norm2.variance_epsilon
        self.o_proj: torch.nn.Linear = attention.o_proj
        self.down_proj: torch.nn.Linear = mlp.down_proj
        self.qkv: tuple[torch.nn.Linear, ...] = (attention.q_proj, attention.k_proj, attention.v_proj)
        self.gate_up: tuple[torch.nn.Linear, ...] = (mlp.gate_proj, mlp.up_proj)
        self.qkv_weight, self.qkv_bias = _fuse(self.qkv)
        self.gate_up_weight, self.gate_up_bias = _fuse(self.gate_up)

    def is_current(self) -> bool:
        return (self.qkv[0].weight.data_ptr() == self.qkv_weight.data_ptr()
                and self.gate_up[0].weight.data_ptr() == self.gate_up_weight.data_ptr())


def _fuse(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along the output dimension and rebind
    each module's parameters to views of the result, so that both stay one storage."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([
            linear.bias.detach() if linear.bias is not None else weight.new_zeros(linear.out_features)
            for linear in linears
        ])
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight.data = weight[start:end]
        if bias is not None and linear.bias is not None:
            linear.bias.data = bias[start:end]
        start = end
    return weight, bias
