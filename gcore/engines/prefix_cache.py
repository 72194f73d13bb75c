"""The ``hf`` engine's prefix cache: the keys and values of prompts it prefilled, kept by their token ids, so that a
prompt that extends one of them (a multi-turn episode's next turn: its prompt so far, the reply, the observation)
prefills only its new suffix (docs/engines.md, "Prefix cache").

An entry is one prompt's KV, per layer ``(keys, values)`` of shape ``[kv_heads, length, head_dim]`` on the engine's
device. Entries are evicted least recently used first to stay within ``max_tokens`` tokens in all; an entry stored
by the ``generate`` call in progress is never evicted by another of the same call (a batch larger than the bound
keeps the prompts that fit, rather than evicting each before its next turn). The engine drops every entry when its
weights change (``update_weights``) and on ``sleep``: a KV computed with other weights is never reused.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

#: one prompt's keys and values, per layer: ``[kv_heads, length, head_dim]`` each
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PrefixStats:
    """What the cache did since the engine was set up (cumulative counts)."""

    lookups: int = 0  # distinct text prompts looked up
    hits: int = 0  # of them, those that found a cached prefix
    hit_tokens: int = 0  # prompt tokens whose KV came from the cache (not prefilled)
    prefilled_tokens: int = 0  # prompt tokens prefilled (run through the model), cache or not
    stored: int = 0  # entries stored
    evicted: int = 0  # entries evicted to stay within the bound
    dropped: int = 0  # times the whole cache was dropped (weights changed, sleep)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PrefixCache:
    """Prompts' KV by their token ids, least recently used evicted past ``max_tokens`` tokens in all."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"a prefix cache holds at least one token, not {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0  # tokens held, all entries together
        self.stats = PrefixStats()
        self._entries: OrderedDict[tuple[int, ...], tuple[LayerKV, int]] = OrderedDict()  # kv, the call that stored
        self._lengths: Counter[int] = Counter()  # entry lengths (a lookup tries each once, longest first)
        self._call = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ids: tuple[int, ...]) -> bool:
        return ids in self._entries

    def new_call(self) -> None:
        """A new ``generate`` call begins: what earlier calls stored may now be evicted for it."""
        self._call += 1

    def longest(self, ids: tuple[int, ...]) -> tuple[int, LayerKV | None]:
        """The longest cached prefix of ``ids`` that leaves at least one token to prefill (the next-token logits come
        from the prefill): its length and KV (which may be longer: use its first ``length`` positions), or
        ``(0, None)``. A hit makes the entry the most recently used."""
        self.stats.lookups += 1
        for length in sorted(self._lengths, reverse=True):
            if length > len(ids):
                continue
            key = ids[:length]
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                usable = min(length, len(ids) - 1)
                if usable <= 0:
                    break
                self.stats.hits += 1
                self.stats.hit_tokens += usable
                return usable, entry[0]
        return 0, None

    def put(self, ids: tuple[int, ...], kv: Callable[[], LayerKV]) -> bool:
        """Keep ``kv()`` (per layer ``[kv_heads, len(ids), head_dim]``, made only when it fits) for ``ids``, evicting
        the least recently used entries of earlier calls to make room; False when it does not fit (then nothing is
        evicted)."""
        size = len(ids)
        if size == 0 or size > self.max_tokens:
            return False
        old = self._entries.pop(ids, None)
        if old is not None:
            self._forget(size)
        free = self.max_tokens - self.tokens
        if free < size:  # room from earlier calls' entries, oldest first; none of this call's
            victims, freed = [], 0
            for key, (_, call) in self._entries.items():
                if free + freed >= size:
                    break
                if call == self._call:
                    continue
                victims.append(key)
                freed += len(key)
            if free + freed < size:
                return False
            for key in victims:
                del self._entries[key]
                self._forget(len(key))
                self.stats.evicted += 1
        self._entries[ids] = (kv(), self._call)
        self._lengths[size] += 1
        self.tokens += size
        self.stats.stored += 1
        return True

    def clear(self) -> None:
        """Drop every entry (the weights changed, or the engine sleeps)."""
        if self._entries:
            self.stats.dropped += 1
        self._entries.clear()
        self._lengths.clear()
        self.tokens = 0

    def _forget(self, size: int) -> None:
        self._lengths[size] -= 1
        if self._lengths[size] == 0:
            del self._lengths[size]
        self.tokens -= size
