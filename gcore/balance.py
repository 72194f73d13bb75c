"""Workload balancing by predicted cost (G-Core's third idea).

Each prompt's cost is predicted as ``n * (prompt tokens + expected response tokens)``; the expected
response length is learnt during the run, per prompt (an exponential moving average of what it
produced before) and per prompt-length bucket for prompts not seen yet. A step's prompts are then
split over the controllers with the Karmarkar-Karp largest-differencing method, so that the
controllers finish generating and training together instead of waiting for the unluckiest one.
Every rank computes the same partition from the same, synchronised history: no coordinator.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


def karmarkar_karp(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Split item indices into ``parts`` lists of nearly equal total cost (deterministic).

    The k-way largest differencing method: every item starts as a k-tuple of subsets (the item
    alone in one); the two tuples with the largest spread are merged, pairing the heaviest subset
    of one with the lightest of the other, until one tuple remains. Ties break by index.
    """
    if parts < 1:
        raise ValueError("parts must be >= 1")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for index, cost in enumerate(costs):
        subsets = [(float(cost), [index])] + [(0.0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-float(cost), index, subsets))
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, key_a, a = heapq.heappop(heap)
        _, key_b, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: (-s[0], s[1]))  # heaviest first
        b = sorted(b, key=lambda s: (s[0], s[1]))  # lightest first
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b, strict=False)]
        spread = max(s for s, _ in merged) - min(s for s, _ in merged)
        heapq.heappush(heap, (-spread, min(key_a, key_b), merged))
    subsets = heap[0][2]
    return sorted((sorted(items) for _, items in subsets), key=lambda items: (items[0] if items else 1 << 62))


def round_robin(count: int, parts: int) -> list[list[int]]:
    """The unbalanced baseline: item i goes to part i mod ``parts``."""
    return [list(range(p, count, parts)) for p in range(parts)]


def imbalance(costs: Sequence[float], partition: Sequence[Sequence[int]]) -> float:
    """Heaviest part over the mean part (1.0 is perfect)."""
    loads = [sum(costs[i] for i in part) for part in partition]
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0


class LengthPredictor:
    """Expected response length per prompt, learnt from the run's own history.

    Args:
        default: the guess before anything was seen (e.g. half the generation budget).
        bucket_size: prompts of similar length (``len // bucket_size``) share a fallback estimate.
        decay: weight of the newest observation in a prompt's moving average.
    """

    def __init__(self, default: float, bucket_size: int = 32, decay: float = 0.5) -> None:
        self.default, self.bucket_size, self.decay = float(default), bucket_size, decay
        self.per_prompt: dict[int, float] = {}
        self.per_bucket: dict[int, tuple[float, int]] = {}

    def expected(self, prompt_index: int, prompt_length: int) -> float:
        if prompt_index in self.per_prompt:
            return self.per_prompt[prompt_index]
        total, count = self.per_bucket.get(prompt_length // self.bucket_size, (0.0, 0))
        return total / count if count else self.default

    def observe(self, prompt_index: int, prompt_length: int, response_length: float) -> None:
        old = self.per_prompt.get(prompt_index)
        self.per_prompt[prompt_index] = response_length if old is None else (
            self.decay * response_length + (1 - self.decay) * old)
        bucket = prompt_length // self.bucket_size
        total, count = self.per_bucket.get(bucket, (0.0, 0))
        self.per_bucket[bucket] = (total + response_length, count + 1)

    def state_dict(self) -> dict:
        return {"per_prompt": {str(k): v for k, v in self.per_prompt.items()},
                "per_bucket": {str(k): list(v) for k, v in self.per_bucket.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.per_prompt = {int(k): float(v) for k, v in state["per_prompt"].items()}
        self.per_bucket = {int(k): (float(v[0]), int(v[1])) for k, v in state["per_bucket"].items()}


def micro_batches_by_length(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Rows grouped into micro-batches of ``size`` with similar lengths (less padding).

    Sorting by length before cutting means each micro-batch pads only to its own longest row.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + size] for i in range(0, len(order), size)]


def micro_batches_sharing_prompts(lengths: Sequence[int], prompt_lengths: Sequence[int], prompts: Sequence[Hashable],
                                  size: int, packed: bool = False) -> list[list[int]]:
    """Rows grouped into micro-batches of ``size`` for a forward that runs each distinct prompt of a micro-batch
    once and the replies on top (``share_prompts``): the cheaper, in positions run, of the rows cut in order of
    length (``micro_batches_by_length``: less reply padding, but a prompt's rows may be spread over several
    micro-batches, each running the prompt again) and the rows cut in order of prompt (a prompt's rows together,
    the prompts in order of their longest reply). The replies count padded to the micro-batch's longest, or, with
    ``packed`` (``--backend.pack_responses``: the replies run as one sequence), as their own tokens: then both cuts
    run the same reply positions and only the prompts run again decide. ``lengths`` are whole rows (prompt and
    reply), ``prompts`` any key that is equal for rows of the same prompt."""
    def positions(micro_batches: list[list[int]]) -> int:
        total = 0
        for rows in micro_batches:
            replies = [lengths[i] - prompt_lengths[i] for i in rows]
            total += sum({prompts[i]: prompt_lengths[i] for i in rows}.values())
            total += sum(replies) if packed else len(rows) * max(replies)
        return total

    by_length = micro_batches_by_length(lengths, size)
    longest: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for row, prompt in enumerate(prompts):
        longest[prompt] = max(longest.get(prompt, 0), lengths[row] - prompt_lengths[row])
        first.setdefault(prompt, row)
    order = sorted(range(len(lengths)), key=lambda i: (-longest[prompts[i]], first[prompts[i]], -lengths[i], i))
    by_prompt = [order[i : i + size] for i in range(0, len(order), size)]
    return by_prompt if positions(by_prompt) < positions(by_length) else by_length


def padding_fraction(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> float:
    """Share of padded positions when each group pads to its longest row."""
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups if g)
    real = sum(lengths)
    return 1.0 - real / padded if padded else 0.0
