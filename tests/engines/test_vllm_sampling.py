"""The ``vllm`` engine samples what transformers' ``model.generate`` samples, at the same settings, with the
generation config built the way TRL's GRPOTrainer builds it (issue 36, item 2): the check of sampling_check.py
(first-token distribution, mean reply length and EOS rate over 16 prompts x 256 replies of the peaked tiny model,
thresholds from a parametric bootstrap of the sampling noise), and it fails vLLM at temperature x1.15.
The checkpoint's generation config sets Qwen2.5-Instruct's sampling values, which TRL overrides and vLLM must
ignore (``CHECKPOINT_SAMPLING``).

vLLM samples pad and bos like any token (as ``generate`` does; the ``hf`` engine bans them by default): compared
with TRL's configuration unchanged. Runs where vLLM is installed (its own venv in CI: see .ci/run); skipped elsewhere.
"""

import pytest
import torch
from sampling_check import (
    assert_samples_as_generate,
    exact_at_temperature_one,
    ignored_values_named,
    peaked_checkpoint,
    reference,
    warnings_logged,
    wrong_temperature_distance,
    wrong_temperature_params,
)

from gcore.model import ModelSource

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def peaked_vllm(tmp_path_factory):
    """The peaked tiny model's checkpoint, its tokenizer, the prompts and a vLLM engine on it (one for all cases)."""
    from gcore.engines.vllm import VLLMEngine

    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU backend is not installed on GPU machines")
    path = str(tmp_path_factory.mktemp("peaked_vllm"))
    tokenizer, prompts = peaked_checkpoint(path)
    engine = VLLMEngine(enforce_eager=True, max_model_len=256)
    with warnings_logged("gcore.engines.vllm") as warnings:
        engine.setup(ModelSource(path), torch.device("cpu"))
    try:
        yield path, tokenizer, prompts, engine, warnings
    finally:
        engine.shutdown()


def _replies(engine, prompts, params) -> list[list[list[int]]]:
    return [[g.token_ids for g in group] for group in engine.generate(prompts, params)]


#: (temperature, top_p, top_k): TRL's defaults, top-p and top-k each once, and both (top-p over the top-k's mass)
SETTINGS = [pytest.param(1.0, 1.0, 0, id="t1.0"), pytest.param(0.7, 0.9, 0, id="t0.7-top_p0.9"),
            pytest.param(1.0, 1.0, 8, id="t1.0-top_k8"), pytest.param(1.0, 0.8, 8, id="t1.0-top_k8-top_p0.8")]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS)
def test_vllm_engine_samples_as_generate(peaked_vllm, temperature, top_p, top_k):
    path, tokenizer, prompts, engine, _ = peaked_vllm
    ref = reference(path, tokenizer, prompts, temperature=temperature, top_p=top_p, top_k=top_k)
    assert_samples_as_generate(_replies(engine, prompts, ref.params), ref)


def test_detects_a_wrong_temperature(peaked_vllm):
    """The check can fail: vLLM's samples at temperature 1.15 are told apart from the distribution at 1.0."""
    path, tokenizer, prompts, engine, _ = peaked_vllm
    exact = exact_at_temperature_one(path, tokenizer, prompts)
    distance, threshold = wrong_temperature_distance(_replies(engine, prompts, wrong_temperature_params()), exact)
    print(f"temperature x1.15: first-token distance {distance:.4f}, threshold {threshold:.4f}")
    assert distance > threshold


def test_the_checkpoints_sampling_values_are_named(peaked_vllm):
    """The checkpoint's generation config sets Qwen2.5-Instruct's sampling values (``CHECKPOINT_SAMPLING``):
    ``setup`` names them in a warning. That vLLM does not apply them is what the comparisons with ``generate``
    show (TRL's configuration overrides each of them)."""
    *_, warnings = peaked_vllm
    assert ignored_values_named(warnings), warnings
