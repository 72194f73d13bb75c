"""The ``hf`` engine samples what transformers' ``model.generate`` samples, at the same settings, with the
generation config built the way TRL's GRPOTrainer builds it (issue 36, item 2): the check of sampling_check.py
(first-token distribution, mean reply length and EOS rate over 16 prompts x 256 replies of the peaked tiny model,
thresholds from a parametric bootstrap of the sampling noise), and it fails a sampler at temperature x1.15.

The engine bans pad and bos inside replies unless ``sample_special_tokens=True`` (docs/engines.md, "Sampling");
the test runs both: with the flag, against TRL's configuration unchanged; without it, against ``generate`` with
those tokens in ``suppress_tokens`` (and shows that the ban is a real difference on this model).
"""

from __future__ import annotations

import os

import pytest
import torch
from sampling_check import (
    DRAWS,
    assert_samples_as_generate,
    exact_at_temperature_one,
    first_token_counts,
    peaked_checkpoint,
    reference,
    wrong_temperature_distance,
    wrong_temperature_params,
)

from gcore.engines.base import checkpoint_generation_config, ignored_generation_values
from gcore.engines.hf import HFEngine
from gcore.model import ModelConfig, ModelSource, build_tiny_model, char_tokenizer
from gcore.types import SamplingParams


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """The tiny model with its final norm x6, its tokenizer and the prompts."""
    path = str(tmp_path_factory.mktemp("peaked"))
    tokenizer, prompts = peaked_checkpoint(path)
    return path, tokenizer, prompts


def engine_replies(path: str, prompts, params: SamplingParams, sample_special_tokens: bool) -> list[list[list[int]]]:
    engine = HFEngine(sample_special_tokens=sample_special_tokens)
    engine.setup(ModelSource(path), torch.device("cpu"))
    try:
        torch.manual_seed(1)
        return [[g.token_ids for g in group] for group in engine.generate(prompts, params)]
    finally:
        engine.shutdown()


#: (temperature, top_p, top_k, sample_special_tokens): TRL's defaults with both choices of the flag, top-p and top-k
#: each once, and both (top-p over the top-k's mass)
SETTINGS = [pytest.param(1.0, 1.0, 0, True, id="t1.0-special-sampled"),
            pytest.param(1.0, 1.0, 0, False, id="t1.0-special-banned"),
            pytest.param(0.7, 0.9, 0, False, id="t0.7-top_p0.9"),
            pytest.param(1.0, 1.0, 8, True, id="t1.0-top_k8"),
            pytest.param(1.0, 0.8, 8, True, id="t1.0-top_k8-top_p0.8")]


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "sample_special_tokens"), SETTINGS)
def test_hf_engine_samples_as_generate(peaked, temperature, top_p, top_k, sample_special_tokens):
    path, tokenizer, prompts = peaked
    # the engine's default ban: generate with the same tokens suppressed
    banned = [] if sample_special_tokens else [tokenizer.pad_token_id, tokenizer.bos_token_id]
    ref = reference(path, tokenizer, prompts, temperature=temperature, top_p=top_p, top_k=top_k, banned=banned)
    assert_samples_as_generate(engine_replies(path, prompts, ref.params, sample_special_tokens), ref)


def test_detects_a_wrong_temperature(peaked):
    """The check can fail: samples at temperature 1.15 are told apart from the distribution at 1.0."""
    path, tokenizer, prompts = peaked
    exact = exact_at_temperature_one(path, tokenizer, prompts)
    distance, threshold = wrong_temperature_distance(engine_replies(path, prompts, wrong_temperature_params(), True),
                                                     exact)
    assert distance > threshold


def test_banning_special_tokens_is_a_real_difference(peaked):
    """On this model pad and bos hold enough first-token mass that the default ban shows: what
    ``sample_special_tokens`` chooses is not a no-op (for SmolLM2, pad is EOS and only bos is banned)."""
    path, tokenizer, prompts = peaked
    exact = exact_at_temperature_one(path, tokenizer, prompts)
    special = exact[:, [tokenizer.pad_token_id, tokenizer.bos_token_id]].sum(-1)
    assert float(special.mean()) > 1e-3
    banned = engine_replies(path, prompts, SamplingParams(n=DRAWS, max_new_tokens=1), False)
    counts = first_token_counts(banned, exact.shape[1])
    assert counts[:, [tokenizer.pad_token_id, tokenizer.bos_token_id]].sum() == 0


def test_generation_config_values_the_engine_ignores(tmp_path, caplog):
    """A checkpoint whose generation config sets sampling values (as Qwen2.5-Instruct's does): the engine names
    them in a warning; transformers' unset fields and no-op values are not named. (The vllm and sglang engines' own
    warnings: their sampling tests.)"""
    from transformers import GenerationConfig

    assert ignored_generation_values(GenerationConfig(eos_token_id=2, pad_token_id=2, bos_token_id=1)) == {}
    assert ignored_generation_values(GenerationConfig(top_k=0, repetition_penalty=1.0, temperature=1.0)) == {}
    values = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert ignored_generation_values(values) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                 "repetition_penalty": 1.05}

    tokenizer = char_tokenizer()
    model = build_tiny_model(ModelConfig(num_hidden_layers=1), tokenizer, seed=0)
    model.generation_config.repetition_penalty = 1.1
    model.save_pretrained(str(tmp_path))
    engine = HFEngine()
    with caplog.at_level("WARNING", logger="gcore.engines.hf"):
        engine.setup(ModelSource(str(tmp_path)), torch.device("cpu"))
    engine.shutdown()
    assert "repetition_penalty=1.1" in caplog.text and os.fspath(tmp_path) in caplog.text
    # what the vllm and sglang engines read (they load no transformers model): the file, or None without one
    assert ignored_generation_values(checkpoint_generation_config(str(tmp_path))) == {"repetition_penalty": 1.1}
    assert checkpoint_generation_config(str(tmp_path / "nothing")) is None
