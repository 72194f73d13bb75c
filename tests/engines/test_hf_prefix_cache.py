"""The ``hf`` engine's prefix cache (``--engine.prefix_cache_tokens``): a multi-turn episode prefills only its new
tokens, samples exactly what the engine without the cache samples, and never reuses a KV of other weights."""

import pytest
import torch
from conftest import HF_PROMPTS, hf_checkpoint

from gcore import HFEngine, SamplingParams
from gcore.engines.prefix_cache import PrefixCache
from gcore.errors import ConfigError
from gcore.model import ModelSource


def _engine(path: str, cache_tokens: int, static_cache: bool = True) -> HFEngine:
    engine = HFEngine(prefix_cache_tokens=cache_tokens, static_cache=static_cache)
    engine.setup(ModelSource(path), torch.device("cpu"))
    return engine


def _episodes(engine: HFEngine, params: SamplingParams, turns: int, seed: int = 0):
    """``turns`` turns of the HF_PROMPTS episodes (prompts of different lengths, one repeated): each turn's prompt
    is the last one, its reply and an observation whose length differs per episode and turn, so that one batch
    mixes cached prefixes of different lengths. Returns every turn's generations and the prompt tokens sent."""
    prompts = [list(p) for p in HF_PROMPTS]
    turns_out, sent = [], 0
    torch.manual_seed(seed)
    for turn in range(turns):
        outputs = engine.generate(prompts, params)
        sent += sum(len(p) for p in {tuple(p) for p in prompts})  # the engine prefills each distinct prompt once
        turns_out.append(outputs)
        prompts = [p + out[0].token_ids + [3 + (row + turn) % 30 for _ in range(1 + (row * 3 + turn) % 4)]
                   for row, (p, out) in enumerate(zip(prompts, outputs, strict=True))]
    return turns_out, sent


def _assert_same(a, b, atol=1e-5) -> float:
    gap = 0.0
    for turn_a, turn_b in zip(a, b, strict=True):
        for group_a, group_b in zip(turn_a, turn_b, strict=True):
            for x, y in zip(group_a, group_b, strict=True):
                assert x.token_ids == y.token_ids and x.finished == y.finished
                if x.logprobs:
                    gap = max(gap, float((torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max()))
    assert gap < atol
    return gap


@pytest.mark.parametrize("model_type, static_cache", [("qwen2", True), ("llama", True), ("qwen2", False)],
                         ids=["qwen2-static", "llama-static", "qwen2-dynamic"])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_a_multi_turn_run_samples_the_same_with_and_without_the_cache(tmp_path, model_type, static_cache, temperature):
    """Same ids (greedy, and sampled from the same seed) and log-probabilities within the engine-vs-forward tolerance
    (1e-5), while the cached engine prefills far fewer prompt tokens: the cache was hit."""
    path = hf_checkpoint(tmp_path, model_type)
    params = SamplingParams(n=1, max_new_tokens=6, temperature=temperature, stop_token_ids=(2,))
    plain, _ = _episodes(_engine(path, 0, static_cache), params, turns=5)
    cached_engine = _engine(path, 4096, static_cache)
    cached, sent = _episodes(cached_engine, params, turns=5)
    _assert_same(plain, cached)
    stats = cached_engine.prefix_stats
    assert stats["hits"] > 0 and stats["hit_tokens"] > 0
    assert stats["prefilled_tokens"] + stats["hit_tokens"] == sent  # every prompt token prefilled or reused
    assert stats["prefilled_tokens"] < sent / 2  # 5 turns: most of each prompt is its previous turn's


def test_n_samples_of_a_prompt_share_its_cached_prefix(tmp_path):
    path = hf_checkpoint(tmp_path, "qwen2")
    params = SamplingParams(n=3, max_new_tokens=4, temperature=0.9, stop_token_ids=(2,))
    engine = _engine(path, 4096)
    first = engine.generate([[1, 5, 6, 7, 8]], params)
    follow = [[1, 5, 6, 7, 8] + g.token_ids + [9, 10] for g in first[0]]
    torch.manual_seed(3)
    cached = engine.generate(follow, params.__class__(n=1, max_new_tokens=4, temperature=0.9, stop_token_ids=(2,)))
    assert engine.prefix_stats["hit_tokens"] >= 3 * 5
    torch.manual_seed(3)
    plain = _engine(path, 0).generate(follow, SamplingParams(n=1, max_new_tokens=4, temperature=0.9,
                                                              stop_token_ids=(2,)))
    _assert_same([plain], [cached])


def _perturbed(engine: HFEngine) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(name, tensor + 0.5 * torch.randn(tensor.shape, generator=generator))
            for name, tensor in engine.model.state_dict().items()]


def test_a_weight_update_drops_the_cache(tmp_path, monkeypatch):
    """After ``update_weights`` the next turn equals a fresh engine's with the new weights; kept KV of the old
    weights would change it (checked: the same run with the drop disabled differs)."""
    path = hf_checkpoint(tmp_path, "qwen2")
    params = SamplingParams(n=1, max_new_tokens=6, temperature=0.0, stop_token_ids=(2,))

    def second_turn(engine: HFEngine, new_weights) -> list:
        prompts = [list(p) for p in HF_PROMPTS]
        first = engine.generate(prompts, params)
        engine.update_weights(new_weights)
        follow = [p + out[0].token_ids + [4, 5, 6] for p, out in zip(prompts, first, strict=True)]
        return follow, engine.generate(follow, params)

    engine = _engine(path, 4096)
    new_weights = _perturbed(engine)
    follow, after = second_turn(engine, new_weights)
    assert engine.prefix_stats["dropped"] == 1 and engine.prefix_stats["hits"] == 0
    fresh = _engine(path, 0)
    fresh.update_weights(new_weights)
    _assert_same([fresh.generate(follow, params)], [after])

    stale = _engine(path, 4096)
    assert stale._prefix is not None
    monkeypatch.setattr(stale._prefix, "clear", lambda: None)  # what the engine did before: KV kept across updates
    _, reused = second_turn(stale, new_weights)
    assert stale.prefix_stats["hits"] > 0
    expected = fresh.generate(follow, params)
    gaps = [max(abs(u - v) for u, v in zip(x[0].logprobs, y[0].logprobs, strict=False))
            for x, y in zip(expected, reused, strict=True)]
    assert max(gaps) > 1e-3  # stale KV shows: the check above can fail


def test_sleep_drops_the_cache(tmp_path):
    engine = _engine(hf_checkpoint(tmp_path, "qwen2"), 4096)
    engine.generate(HF_PROMPTS, SamplingParams(n=1, max_new_tokens=3, temperature=0.0))
    assert engine.prefix_stats["held_tokens"] > 0
    engine.sleep()
    assert engine.prefix_stats["held_tokens"] == 0 and engine.prefix_stats["dropped"] == 1


def test_the_bound_holds_and_evicts_least_recently_used_first():
    cache = PrefixCache(10)
    kv = lambda: [(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))]  # noqa: E731
    cache.new_call()
    assert cache.put((1, 2, 3, 4), kv) and cache.put((5, 6, 7, 8), kv)
    assert not cache.put((9, 10, 11, 12), kv)  # this call's entries are not evicted for one another
    cache.new_call()
    assert cache.longest((1, 2, 3, 4, 99)) == (4, cache._entries[(1, 2, 3, 4)][0])  # now the most recently used
    assert cache.put((9, 10, 11, 12), kv)  # evicts (5, 6, 7, 8), the least recently used
    assert (5, 6, 7, 8) not in cache and (1, 2, 3, 4) in cache and cache.tokens == 8 <= 10
    assert cache.stats.evicted == 1
    assert cache.longest((1, 2, 3, 4))[0] == 3  # a whole cached prompt still prefills its last token
    assert not cache.put(tuple(range(11)), kv)  # longer than the bound: never kept
    assert cache.longest((5, 6, 7, 8, 9)) == (0, None)


def test_a_small_bound_evicts_and_still_samples_the_same(tmp_path):
    path = hf_checkpoint(tmp_path, "qwen2")
    params = SamplingParams(n=1, max_new_tokens=5, temperature=0.0, stop_token_ids=(2,))
    plain, _ = _episodes(_engine(path, 0), params, turns=4)
    small = _engine(path, 40)
    cached, _ = _episodes(small, params, turns=4)
    _assert_same(plain, cached)
    assert small.prefix_stats["evicted"] > 0 and small.prefix_stats["hits"] > 0
    assert small._prefix is not None and small._prefix.tokens <= 40


def test_zero_turns_it_off_and_a_negative_bound_is_one_line(tmp_path):
    engine = _engine(hf_checkpoint(tmp_path, "qwen2"), 0)
    engine.generate(HF_PROMPTS, SamplingParams(n=1, max_new_tokens=2))
    assert engine._prefix is None and engine.prefix_stats["lookups"] == 0
    with pytest.raises(ConfigError, match=r"--engine.prefix_cache_tokens -1: a number of tokens >= 0"):
        HFEngine(prefix_cache_tokens=-1)


def test_an_engine_worker_reuses_turns_and_drops_them_on_a_weight_sync(tmp_path):
    """The engine a pool worker holds (its runtime, in this process): the second turn hits the cache; a weight sync
    through the shared weight file drops it, and the next turn equals a fresh engine's with the synced weights."""
    from gcore.engines.pool import POLICY, RoleSpec, _WorkerRuntime
    from gcore.engines.pool.weights import create_shared, remove

    path = hf_checkpoint(tmp_path, "qwen2")
    params = SamplingParams(n=1, max_new_tokens=5, temperature=0.0, stop_token_ids=(2,))
    runtime = _WorkerRuntime({POLICY: RoleSpec(HFEngine(prefix_cache_tokens=4096), ModelSource(path))},
                             release=True, device=torch.device("cpu"))
    runtime.switch(POLICY, None)
    engine = runtime._engine(POLICY)
    assert isinstance(engine, HFEngine)
    prompts = [list(p) for p in HF_PROMPTS]
    first = runtime.generate(POLICY, prompts, params)
    second_prompts = [p + g[0].token_ids + [7, 8] for p, g in zip(prompts, first, strict=True)]
    second = runtime.generate(POLICY, second_prompts, params)
    assert engine.prefix_stats["hit_tokens"] > 0
    new_weights = _perturbed(engine)
    shared = create_shared(new_weights)
    try:
        for (_, view), (_, tensor) in zip(shared.views(), new_weights, strict=True):
            view.copy_(tensor)
        runtime.sync(shared.ref())
    finally:
        remove(shared.path)
    assert engine.prefix_stats["dropped"] == 1 and engine.prefix_stats["held_tokens"] == 0
    third_prompts = [p + g[0].token_ids + [9] for p, g in zip(second_prompts, second, strict=True)]
    third = runtime.generate(POLICY, third_prompts, params)
    fresh = _engine(path, 0)
    fresh.update_weights(new_weights)
    _assert_same([fresh.generate(third_prompts, params)], [third])
