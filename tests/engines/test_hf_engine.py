"""The ``hf`` engine's static-cache decoder samples what the model's own forward gives."""

import pytest
import torch
from conftest import HF_PROMPTS, hf_checkpoint

from gcore import HFEngine, SamplingParams
from gcore.backends import token_logprobs
from gcore.engines.hf import StaticCacheDecoder
from gcore.model import ModelSource


def _engine(path: str, static_cache: bool) -> HFEngine:
    engine = HFEngine(static_cache=static_cache)
    engine.setup(ModelSource(path), torch.device("cpu"))
    return engine


def _max_gap(engine: HFEngine, prompts, outputs, temperature: float) -> float:
    """Largest difference between the engine's log-probabilities and a full forward of the same tokens."""
    gap = 0.0
    for prompt, generations in zip(prompts, outputs, strict=False):
        for g in generations:
            ids = torch.tensor([prompt + g.token_ids])
            with torch.no_grad():
                logprobs, _ = token_logprobs(engine.model(input_ids=ids).logits, ids, temperature)
            gap = max(gap, float((logprobs[0, len(prompt) - 1 :] - torch.tensor(g.logprobs)).abs().max()))
    return gap


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_static_decoder_matches_the_model_forward(tmp_path, model_type):
    path = hf_checkpoint(tmp_path, model_type)
    engine = _engine(path, static_cache=True)
    params = SamplingParams(n=3, max_new_tokens=10, temperature=0.8, stop_token_ids=(2,))
    torch.manual_seed(1)
    outputs = engine.generate(HF_PROMPTS, params)
    assert engine._decoder is not None  # the static path ran
    assert [len(group) for group in outputs] == [3, 3, 3, 3]
    assert _max_gap(engine, HF_PROMPTS, outputs, params.temperature) < 1e-5


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_static_and_dynamic_cache_agree_when_greedy(tmp_path, model_type):
    path = hf_checkpoint(tmp_path, model_type)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    static = _engine(path, static_cache=True).generate(HF_PROMPTS, params)
    dynamic_engine = _engine(path, static_cache=False)
    dynamic = dynamic_engine.generate(HF_PROMPTS, params)
    assert dynamic_engine._decoder is None
    assert [[g.token_ids for g in group] for group in static] == [[g.token_ids for g in group] for group in dynamic]
    for s_group, d_group in zip(static, dynamic, strict=False):
        for s, d in zip(s_group, d_group, strict=False):
            assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(d.logprobs), atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_rows_that_finish_leave_the_decode_batch_and_nothing_else_changes(tmp_path, model_type, monkeypatch):
    """On CPU the static decoder drops finished rows once half of those decoded have finished
    (``StaticCacheDecoder.keep``). With the same seed it samples what the dynamic-cache path (which decodes every
    row to the end) samples: the same tokens, log-probabilities within float noise, and the same random stream
    after the call."""
    path = hf_checkpoint(tmp_path, model_type)
    params = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, stop_token_ids=(2, 3, 4, 5, 6, 7))
    kept: list[int] = []
    keep = StaticCacheDecoder.keep
    monkeypatch.setattr(StaticCacheDecoder, "keep", lambda self, rows: (kept.append(len(rows)), keep(self, rows)))
    runs = []
    for static_cache in (True, False):
        engine = _engine(path, static_cache=static_cache)
        torch.manual_seed(3)
        runs.append((engine.generate(HF_PROMPTS, params), torch.rand(1)))
    (static, after_static), (dynamic, after_dynamic) = runs
    assert kept, "no row finished early enough to leave the batch: the test needs earlier stops"
    assert [[g.token_ids for g in group] for group in static] == [[g.token_ids for g in group] for group in dynamic]
    assert len({len(g.token_ids) for group in static for g in group}) > 2  # rows ended at different lengths
    for s_group, d_group in zip(static, dynamic, strict=True):
        for s, d in zip(s_group, d_group, strict=True):
            assert s.finished == d.finished
            assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(d.logprobs), atol=1e-5)
    assert torch.equal(after_static, after_dynamic)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_the_fixed_shape_step_matches_the_sliced_step(tmp_path, model_type, monkeypatch):
    """The step a CUDA graph captures (a one-element slot tensor: the whole cache attended, later slots masked)
    gives the sliced step's tokens and log-probabilities. Run on CPU here; ``tests/surface/test_gpu.py`` replays it as a
    graph. The second call reuses the first call's buffers, whose later slots still hold its keys."""
    path = hf_checkpoint(tmp_path, model_type)
    greedy = SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    sampled = SamplingParams(n=3, max_new_tokens=10, temperature=0.8, stop_token_ids=(2,))
    sliced = _engine(path, static_cache=True)
    expected = [g.token_ids for group in sliced.generate(HF_PROMPTS, greedy) for g in group]
    step = StaticCacheDecoder.step
    monkeypatch.setattr(StaticCacheDecoder, "step",
                        lambda self, tokens, positions, slot: step(self, tokens, positions, torch.tensor([slot])))
    fixed = _engine(path, static_cache=True)
    assert [g.token_ids for group in fixed.generate(HF_PROMPTS, greedy) for g in group] == expected
    buffers = fixed._decoder.keys[0].data_ptr()
    other = [[1, 9, 8], [1, 4], [1, 3, 3, 3, 3], [1, 6, 5]]  # same shape as HF_PROMPTS, other tokens
    torch.manual_seed(4)
    outputs = fixed.generate(other, SamplingParams(n=2, max_new_tokens=12, temperature=0.8))
    assert fixed._decoder.keys[0].data_ptr() == buffers  # reused
    assert _max_gap(fixed, other, outputs, 0.8) < 1e-5
    torch.manual_seed(1)
    outputs = fixed.generate(HF_PROMPTS, sampled)  # stop tokens: rows that end early
    assert _max_gap(fixed, HF_PROMPTS, outputs, sampled.temperature) < 1e-5


def test_weight_updates_reach_the_fused_weights(tmp_path):
    path = hf_checkpoint(tmp_path, "qwen2")
    engine = _engine(path, static_cache=True)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0)
    engine.generate(HF_PROMPTS, params)
    decoder = engine._decoder
    # the HF modules' weights are views into the decoder's fused tensors: one storage
    q_proj = engine.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.data_ptr() == decoder.layers[0].qkv_weight.data_ptr()
    new = {name: tensor + 0.01 * torch.randn_like(tensor) for name, tensor in engine.model.state_dict().items()}
    engine.update_weights(new.items())
    assert torch.equal(decoder.layers[0].qkv_weight[: q_proj.out_features],
                       new["model.layers.0.self_attn.q_proj.weight"])
    torch.manual_seed(2)
    outputs = engine.generate(HF_PROMPTS, params)
    assert engine._decoder is decoder  # still current: not rebuilt
    assert _max_gap(engine, HF_PROMPTS, outputs, params.temperature) < 1e-5


def test_unsupported_architectures_fall_back(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2, n_positions=32, bos_token_id=1,
                                       eos_token_id=2, pad_token_id=0))
    assert StaticCacheDecoder.build(model) is None
    path = str(tmp_path / "gpt2")
    model.save_pretrained(path)
    engine = _engine(path, static_cache=True)
    outputs = engine.generate([[1, 5], [1, 6, 7]], SamplingParams(n=2, max_new_tokens=5, temperature=1.0))
    assert engine._decoder is None
    assert all(len(g.token_ids) == len(g.logprobs) > 0 for group in outputs for g in group)
    assert _max_gap(engine, [[1, 5], [1, 6, 7]], outputs, 1.0) < 1e-4


@pytest.mark.parametrize("use_generate", [False, True])
def test_pad_and_bos_are_never_sampled_inside_a_response(tmp_path, use_generate):
    """A pad token inside a response would read as padding (and HF's embedding gives it no gradient,
    megatron's would): the engine never samples pad (0) or bos (1); eos (2) still ends responses.
    With a flat distribution (temperature 5, 40 tokens) about 1 in 40 draws would be each of them."""
    engine = HFEngine(use_generate=use_generate)
    engine.setup(ModelSource(hf_checkpoint(tmp_path, "qwen2")), torch.device("cpu"))
    torch.manual_seed(0)
    outputs = engine.generate(HF_PROMPTS, SamplingParams(n=16, max_new_tokens=12, temperature=5.0))
    tokens = [t for generations in outputs for g in generations for t in g.token_ids]
    assert len(tokens) > 400
    assert 0 not in tokens and 1 not in tokens
    assert 2 in tokens  # the stop token is not banned


def test_a_bfloat16_engine_samples_from_the_trained_weights_cast(tmp_path):
    """``dtype bfloat16``: the engine holds its weights in bfloat16 (the static decoder too), a weight sync from the
    float32 trainer casts them, and what it samples and reports is the bfloat16 model's, within bfloat16 rounding of
    the float32 model's log-probabilities."""
    from gcore.errors import ConfigError

    path = hf_checkpoint(tmp_path, "qwen2")
    engine = HFEngine(dtype="bfloat16")
    engine.setup(ModelSource(path), torch.device("cpu"))  # the checkpoint's own dtype is float32
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    trainer = _engine(path, static_cache=True)  # a float32 copy standing in for the trainer's weights
    new = {name: tensor + 0.05 * torch.randn_like(tensor) for name, tensor in trainer.model.state_dict().items()}
    trainer.update_weights(new.items())
    engine.update_weights(new.items())
    assert torch.equal(engine.model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                       new["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16))
    params = SamplingParams(n=3, max_new_tokens=10, temperature=1.0, stop_token_ids=(2,))
    torch.manual_seed(3)
    outputs = engine.generate(HF_PROMPTS, params)
    assert engine._decoder is not None and engine._decoder.layers[0].qkv_weight.dtype == torch.bfloat16
    assert 1e-4 < _max_gap(trainer, HF_PROMPTS, outputs, 1.0) < 0.2  # bfloat16 rounding: visible, and small
    with pytest.raises(ConfigError, match="--engine.dtype 'fp8': valid choices: auto, float32, bfloat16, float16"):
        HFEngine(dtype="fp8")  # type: ignore[arg-type]


def test_fit_reports_how_far_the_engine_is_from_the_trained_policy(tmp_path):
    """``rollout/logprob_diff``: about 0 when the engine holds the trainer's float32 weights (the same model, other
    kernels), bfloat16 rounding when it holds them in bfloat16."""
    from gcore import GRPO, Trainer, TrainerConfig

    def diff(dtype: str) -> list[float]:
        result = Trainer(trainer=TrainerConfig(max_steps=2, accelerator="cpu", default_root_dir=str(tmp_path / dtype),
                                               enable_progress_bar=False, save_final=False),
                         engine=HFEngine(dtype=dtype), algorithm=GRPO()).fit()  # type: ignore[arg-type]
        # a token mean over the rows that trained (0 in a step where every group scored alike)
        diffs = [row["rollout/logprob_diff"] for row in result.history if row["trained_rows_frac"] > 0]
        assert diffs
        return diffs

    assert all(d < 1e-4 for d in diff("auto"))
    assert all(1e-3 < d < 0.5 for d in diff("bfloat16"))


def _gpt2_checkpoint(tmp_path) -> str:
    """A tiny GPT-2: absolute position embeddings, so left padding without the right position ids shows."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2, n_positions=32, bos_token_id=1,
                                       eos_token_id=2, pad_token_id=0))
    path = str(tmp_path / "gpt2")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "gpt2"])
@pytest.mark.parametrize("max_batch_size", [0, 3])
def test_next_token_logprobs_match_each_prompt_alone(tmp_path, model_type, max_batch_size):
    """Left-padded prompts of different lengths (and a repeated one) give each prompt's own next-token
    log-probabilities: a plain forward of that prompt alone, float32 log-softmax at its last position."""
    path = _gpt2_checkpoint(tmp_path) if model_type == "gpt2" else hf_checkpoint(tmp_path, model_type)
    engine = HFEngine(max_batch_size=max_batch_size)
    engine.setup(ModelSource(path), torch.device("cpu"))
    candidates = [3, 7, 2, 39, 7]
    rows = engine.next_token_logprobs(HF_PROMPTS, candidates)
    assert len(rows) == len(HF_PROMPTS)
    for prompt, row in zip(HF_PROMPTS, rows, strict=True):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        expected = torch.log_softmax(logits.float(), dim=-1)[candidates]
        assert len(row) == len(candidates)
        torch.testing.assert_close(torch.tensor(row), expected, rtol=0, atol=1e-5)
    assert rows[0] != rows[1]  # different prompts, different distributions: not one row repeated
    assert engine.next_token_logprobs([], candidates) == []
