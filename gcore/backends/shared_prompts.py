"""Training forwards that run each distinct prompt of a micro-batch once.

GRPO-style algorithms sample ``n`` responses per prompt, so a micro-batch holds the same prompt up to
``n`` times and a plain forward computes its hidden states ``n`` times. Here the distinct prompts run
once (left-padded, with a KV cache), their keys and values are indexed out to every row that shares
them (a differentiable gather, so the gradient of every response flows back into the one prompt
pass), and the responses run on top of that cache. The per-token log-probabilities, entropies and
gradients equal the plain forward's up to float rounding (tests/backends/test_shared_prompts.py); the work
saved is ``(1 - distinct / rows) * prompt_tokens / all_tokens`` of the forward and backward.
"""

from __future__ import annotations

import torch

from gcore.model import cache_keyword
from gcore.types import RolloutBatch


def prompt_keys(input_ids: torch.Tensor, prompt_lengths: list[int]) -> list[tuple[int, ...]]:
    """Each row's prompt tokens, as a key equal for the rows of the same prompt."""
    return [tuple(input_ids[row, :length].tolist()) for row, length in enumerate(prompt_lengths)]


def distinct_prompts(micro: RolloutBatch, min_saving: float = 0.0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first_row, row_to_prompt)``: one representative row per distinct prompt and, for every row,
    the index of its prompt; ``None`` when sharing would save less than ``min_saving`` of the
    micro-batch's tokens (always when every prompt is distinct), or the batch does not say where
    its prompts end."""
    if micro.prompt_lengths is None or len(micro) < 2:
        return None
    keys: dict[tuple[int, ...], int] = {}
    row_to_prompt, first_row = [], []
    lengths = micro.prompt_lengths.tolist()
    for row, key in enumerate(prompt_keys(micro.input_ids, lengths)):
        if key not in keys:
            keys[key] = len(keys)
            first_row.append(row)
        row_to_prompt.append(keys[key])
    saved = sum(lengths) - sum(len(key) for key in keys)
    if len(keys) == len(micro) or saved < min_saving * float(micro.attention_mask.sum()):
        return None
    return torch.tensor(first_row, dtype=torch.long), torch.tensor(row_to_prompt, dtype=torch.long)


def _prompt_pass(model: torch.nn.Module, micro: RolloutBatch, first_row: torch.Tensor, rows: torch.Tensor,
                 device: torch.device) -> tuple[object, torch.Tensor, torch.Tensor]:
    """The distinct prompts' forward, left-padded so that their last token is the last column: ``(KV cache,
    first_logits [B, V], prompt_mask [D, width])``, ``first_logits[i]`` being the logits of row ``i``'s last prompt
    token (the prediction of its first response token)."""
    prompt_lengths = micro.prompt_lengths
    assert prompt_lengths is not None  # a batch that shares prompts knows their lengths
    width = int(prompt_lengths.max())
    prompt_ids = torch.zeros((len(first_row), width), dtype=torch.long)
    prompt_mask = torch.zeros((len(first_row), width), dtype=torch.long)
    for index, row in enumerate(first_row.tolist()):
        length = int(prompt_lengths[row])
        prompt_ids[index, width - length:] = micro.input_ids[row, :length]
        prompt_mask[index, width - length:] = 1
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    # only the last prompt position's logits are used: the output head runs on that one (logits_to_keep)
    prefix = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_positions, use_cache=True,
                   logits_to_keep=1)
    cache = getattr(prefix, "cache", None) or prefix.past_key_values  # the output's name for it differs across
    return cache, prefix.logits[:, -1][rows], prompt_mask  # transformers releases


def shared_prompt_logits(model: torch.nn.Module, micro: RolloutBatch, first_row: torch.Tensor,
                         row_to_prompt: torch.Tensor, device: torch.device,
                         prefix_model: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every response token of ``micro``: ``(logits [B, R, V], targets [B, R])`` where
    ``R`` is the longest response and row ``i``'s response token ``j`` sits at position
    ``prompt_lengths[i] + j`` of ``input_ids`` (padding beyond a row's response is left to the mask).

    ``prefix_model`` runs the prompts (default: ``model``). Under DDP pass the unwrapped module, so
    that every micro-batch makes exactly one call through the DDP wrapper whether or not it shares
    prompts: DDP's forward joins collectives (buffer broadcast) and prepares the gradient reducer,
    and ranks that decide differently must still make the same calls."""
    from transformers import DynamicCache

    prompt_lengths = micro.prompt_lengths
    assert prompt_lengths is not None  # a batch that shares prompts knows their lengths
    lengths = micro.attention_mask.sum(-1)
    responses = int((lengths - prompt_lengths).max())
    # the responses, right-padded, each starting at its own prompt length
    targets = torch.zeros((len(micro), responses), dtype=torch.long)
    response_mask = torch.zeros((len(micro), responses), dtype=torch.long)
    for row in range(len(micro)):
        start, stop = int(prompt_lengths[row]), int(lengths[row])
        targets[row, : stop - start] = micro.input_ids[row, start:stop]
        response_mask[row, : stop - start] = 1
    targets, response_mask, rows = targets.to(device), response_mask.to(device), row_to_prompt.to(device)
    prompt_cache, first_logits, prompt_mask = _prompt_pass(prefix_model or model, micro, first_row, rows, device)
    if responses == 1:
        return first_logits.unsqueeze(1), targets
    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]  # an HF model: its PretrainedConfig
    for layer_index, layer in enumerate(prompt_cache.layers):  # type: ignore[attr-defined]  # a transformers Cache
        cache.update(layer.keys[rows], layer.values[rows], layer_index)
    # the response tokens but the last (it predicts nothing), on top of their prompt's keys and values
    inputs = targets[:, :-1]
    positions = prompt_lengths.to(device).unsqueeze(1) + torch.arange(responses - 1, device=device)
    mask = torch.cat((prompt_mask[rows], response_mask[:, :-1]), dim=1)
    rest = model(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=False,
                 **{cache_keyword(model): cache}).logits
    return torch.cat((first_logits.unsqueeze(1), rest), dim=1), targets


def packed_attention(model: torch.nn.Module) -> str | None:
    """The mask ``packed_response_logits`` gives ``model``'s attention: ``bool`` for SDPA, ``float`` (added to the
    scores) for eager attention; ``None`` for any other implementation, and for models with sliding-window layers
    (the block mask has no window), which get the padded layout."""
    config = getattr(model, "config", None)
    layer_types = getattr(config, "layer_types", None)
    sliding = (any("sliding" in str(t) for t in layer_types) if layer_types
               else getattr(config, "sliding_window", None) is not None)
    if sliding:
        return None
    return {"sdpa": "bool", "eager": "float"}.get(str(getattr(config, "_attn_implementation", None)))


def packing_saves(micro: RolloutBatch, distinct: int, config: object) -> bool:
    """Whether ``packed_response_logits`` does fewer multiply-adds than ``shared_prompt_logits`` on ``micro``
    (``distinct`` prompts): packing runs no padding through the layers and the output head, but its attention is
    one block of every response token against all prompts' keys and all response tokens. Per token, a layer's
    weights and the output head; per (query, key) pair, ``2 * hidden`` per layer."""
    assert micro.prompt_lengths is not None
    hidden = int(getattr(config, "hidden_size", 0))
    layers = int(getattr(config, "num_hidden_layers", 0))
    inter = int(getattr(config, "intermediate_size", 4 * hidden))
    vocab = int(getattr(config, "vocab_size", 0))
    per_token = layers * (4 * hidden * hidden + 3 * hidden * inter) + vocab * hidden
    per_pair = 2 * hidden * layers
    replies = (micro.attention_mask.sum(-1) - micro.prompt_lengths - 1).clamp(min=0)
    width, longest, rows = int(micro.prompt_lengths.max()), int(replies.max()), len(micro)
    packed_tokens = int(replies.sum())
    padded = rows * longest * (per_token + per_pair * (width + longest))
    packed = packed_tokens * (per_token + per_pair * (distinct * width + packed_tokens))
    return packed < padded


def packed_response_logits(model: torch.nn.Module, micro: RolloutBatch, first_row: torch.Tensor,
                           row_to_prompt: torch.Tensor, device: torch.device,
                           prefix_model: torch.nn.Module | None = None) -> tuple[torch.Tensor, ...]:
    """``shared_prompt_logits`` without padding: ``(logits [N, V], targets [N], rows [N], columns [N])`` for the
    ``N`` response tokens of ``micro``, token ``(rows[k], columns[k])`` of ``shared_prompt_logits``'s layout.

    After the distinct prompts' pass, the response tokens of every row (but each row's last) run as one packed
    sequence on top of all the prompts' keys and values, under a mask that lets each token see its own prompt and
    the tokens before it in its own response (``packed_attention`` says the mask's kind). The output head and the
    layers run on the response tokens alone, where the padded layout runs ``rows x longest response``."""
    from transformers import DynamicCache

    prompt_lengths = micro.prompt_lengths
    assert prompt_lengths is not None  # a batch that shares prompts knows their lengths
    lengths = micro.attention_mask.sum(-1)
    rows = row_to_prompt.to(device)
    prompt_cache, first_logits, prompt_mask = _prompt_pass(prefix_model or model, micro, first_row, rows, device)
    # per row: its first response token (predicted by the prompt pass), the tokens but the last (inputs here),
    # their positions, and the tokens they predict with their columns in the response
    first_targets, inputs, positions, segment, columns, rest_targets = [], [], [], [], [], []
    for row in range(len(micro)):
        start, stop = int(prompt_lengths[row]), int(lengths[row])
        response = micro.input_ids[row, start:stop]
        first_targets.append(response[:1])
        inputs.append(response[:-1])
        rest_targets.append(response[1:])
        positions.append(torch.arange(start, stop - 1))
        columns.append(torch.arange(1, stop - start))
        segment.append(torch.full((stop - start - 1,), row))
    targets_first = torch.cat(first_targets).to(device)
    index_rows = torch.arange(len(micro), device=device)
    index_columns = torch.zeros(len(micro), dtype=torch.long, device=device)
    packed = torch.cat(inputs)
    if not len(packed):
        return first_logits, targets_first, index_rows, index_columns
    seg, column, targets_rest = (torch.cat(parts).to(device) for parts in (segment, columns, rest_targets))
    # every prompt's keys and values side by side on one row: [1, heads, distinct x width, head_dim]
    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]  # an HF model: its PretrainedConfig
    for layer_index, layer in enumerate(prompt_cache.layers):  # type: ignore[attr-defined]  # a transformers Cache
        keys, values = (t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[3]).unsqueeze(0)
                        for t in (layer.keys, layer.values))
        cache.update(keys, values, layer_index)
    distinct, width = prompt_mask.shape
    key_prompt = torch.arange(distinct, device=device).repeat_interleave(width)
    sees_prompt = (key_prompt.unsqueeze(0) == rows[seg].unsqueeze(1)) & prompt_mask.reshape(-1).bool().unsqueeze(0)
    order = torch.arange(len(packed), device=device)
    sees_response = (seg.unsqueeze(0) == seg.unsqueeze(1)) & (order.unsqueeze(0) <= order.unsqueeze(1))
    mask = torch.cat((sees_prompt, sees_response), dim=1)[None, None]
    if packed_attention(model) == "float":
        mask = torch.zeros(mask.shape, dtype=first_logits.dtype, device=device).masked_fill(
            ~mask, torch.finfo(first_logits.dtype).min)
    rest = model(input_ids=packed.to(device).unsqueeze(0), attention_mask=mask,
                 position_ids=torch.cat(positions).to(device).unsqueeze(0), use_cache=False,
                 **{cache_keyword(model): cache}).logits[0]
    return (torch.cat((first_logits, rest)), torch.cat((targets_first, targets_rest)),
            torch.cat((index_rows, seg)), torch.cat((index_columns, column)))


def to_response_layout(values: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, batch: int) -> torch.Tensor:
    """``packed_response_logits``'s per-token ``values [N]`` -> ``shared_prompt_logits``'s ``[B, R]`` (zeros beyond
    each row's response). Differentiable."""
    out = values.new_zeros((batch, int(columns.max()) + 1))
    return out.index_put((rows, columns), values)


def to_batch_layout(per_response: torch.Tensor, micro: RolloutBatch) -> torch.Tensor:
    """``[B, R]`` values of the response tokens -> the batch's ``[B, L-1]`` layout (position ``t``
    holds the prediction of token ``t + 1``; zeros elsewhere). Differentiable."""
    rows, responses = per_response.shape
    width = micro.input_ids.shape[1] - 1
    assert micro.prompt_lengths is not None  # a batch that shares prompts knows their lengths
    start = micro.prompt_lengths.to(per_response.device) - 1
    index = start.unsqueeze(1) + torch.arange(responses, device=per_response.device)  # unique per row
    out = per_response.new_zeros((rows, int(index.max()) + 1 if index.numel() else width))
    out = out.scatter(1, index, per_response)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]))
    return out[:, :width]
