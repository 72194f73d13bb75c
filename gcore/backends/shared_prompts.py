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
    width = int(prompt_lengths.max())
    responses = int((lengths - prompt_lengths).max())
    # the distinct prompts, left-padded so that their last token is the last column
    prompt_ids = torch.zeros((len(first_row), width), dtype=torch.long)
    prompt_mask = torch.zeros((len(first_row), width), dtype=torch.long)
    for index, row in enumerate(first_row.tolist()):
        length = int(prompt_lengths[row])
        prompt_ids[index, width - length:] = micro.input_ids[row, :length]
        prompt_mask[index, width - length:] = 1
    # the responses, right-padded, each starting at its own prompt length
    targets = torch.zeros((len(micro), responses), dtype=torch.long)
    response_mask = torch.zeros((len(micro), responses), dtype=torch.long)
    for row in range(len(micro)):
        start, stop = int(prompt_lengths[row]), int(lengths[row])
        targets[row, : stop - start] = micro.input_ids[row, start:stop]
        response_mask[row, : stop - start] = 1
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    targets, response_mask, rows = targets.to(device), response_mask.to(device), row_to_prompt.to(device)

    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    # only the last prompt position's logits are used: the output head runs on that one (logits_to_keep)
    prefix = (prefix_model or model)(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_positions,
                                     use_cache=True, logits_to_keep=1)
    first_logits = prefix.logits[:, -1][rows]  # the last prompt token predicts the first response token
    if responses == 1:
        return first_logits.unsqueeze(1), targets
    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]  # an HF model: its PretrainedConfig
    prompt_cache = getattr(prefix, "cache", None) or prefix.past_key_values  # the output's name for it differs
    for layer_index, layer in enumerate(prompt_cache.layers):  # across transformers releases
        cache.update(layer.keys[rows], layer.values[rows], layer_index)
    # the response tokens but the last (it predicts nothing), on top of their prompt's keys and values
    inputs = targets[:, :-1]
    positions = prompt_lengths.to(device).unsqueeze(1) + torch.arange(responses - 1, device=device)
    mask = torch.cat((prompt_mask[rows], response_mask[:, :-1]), dim=1)
    rest = model(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=False,
                 **{cache_keyword(model): cache}).logits
    return torch.cat((first_logits.unsqueeze(1), rest), dim=1), targets


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
