"""The ``sglang`` engine samples what transformers' ``model.generate`` samples, at the same settings, with the
generation config built the way TRL's GRPOTrainer builds it (issue 36, item 2): the check of sampling_check.py
(first-token distribution, mean reply length and EOS rate over 16 prompts x 256 replies of the peaked tiny model,
thresholds from a parametric bootstrap of the sampling noise), and it fails SGLang at temperature x1.15.
The checkpoint's generation config sets Qwen2.5-Instruct's sampling values, which TRL overrides and SGLang must
ignore (``CHECKPOINT_SAMPLING``).

SGLang samples pad and bos like any token (as ``generate`` does; the ``hf`` engine bans them by default): compared
with TRL's configuration unchanged. Runs where SGLang is installed (on CPUs its own venv made by
scripts/install_sglang_cpu.sh, the last part of .ci/run); skipped elsewhere.
"""

import pytest
import torch
from sampling_check import (
    DRAWS,
    assert_samples_as_generate,
    exact_at_temperature_one,
    first_token_counts,
    ignored_values_named,
    load_model,
    mean_tv,
    measure,
    null_quantile,
    peaked_checkpoint,
    reference,
    warnings_logged,
    wrong_temperature_distance,
    wrong_temperature_params,
)

from gcore.errors import ConfigError
from gcore.model import ModelSource

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def peaked_sglang(tmp_path_factory):
    """The peaked tiny model's checkpoint, its tokenizer, the prompts and an SGLang engine on it (one for all
    cases)."""
    from gcore.engines.sglang import SGLangEngine

    if torch.cuda.is_available():
        pytest.skip("SGLang's CPU engine is installed on CPU-only machines")
    path = str(tmp_path_factory.mktemp("peaked_sglang"))
    tokenizer, prompts = peaked_checkpoint(path)
    engine = SGLangEngine(cpu_threads=1, timeout_s=300)
    with warnings_logged("gcore.engines.sglang") as warnings:
        engine.setup(ModelSource(path), torch.device("cpu"))
    try:
        yield path, tokenizer, prompts, engine, warnings
    finally:
        engine.shutdown()


def _replies(engine, prompts, params) -> list[list[list[int]]]:
    return [[g.token_ids for g in group] for group in engine.generate(prompts, params)]


#: (temperature, top_p, top_k): TRL's defaults, top-p and top-k each once
SETTINGS = [pytest.param(1.0, 1.0, 0, id="t1.0"), pytest.param(0.7, 0.9, 0, id="t0.7-top_p0.9"),
            pytest.param(1.0, 1.0, 8, id="t1.0-top_k8")]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS)
def test_sglang_engine_samples_as_generate(peaked_sglang, temperature, top_p, top_k):
    path, tokenizer, prompts, engine, _ = peaked_sglang
    ref = reference(path, tokenizer, prompts, temperature=temperature, top_p=top_p, top_k=top_k)
    assert_samples_as_generate(_replies(engine, prompts, ref.params), ref)


def joint_first_token(path: str, prompts, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``[prompts, vocab]``: the first token's distribution under SGLang's rule for top-k with top-p (its torch
    sampler, ``top_k_top_p_min_p_sampling_from_probs_torch``; FlashInfer's ``joint`` order on GPUs): a token is kept
    when it is among the top-k and the mass of the tokens above it is at most ``top_p`` of the whole distribution."""
    model = load_model(path)
    rows = []
    with torch.no_grad():
        for p in prompts:
            probs = torch.softmax(model(input_ids=torch.tensor([p])).logits[0, -1].float() / temperature, dim=-1)
            ordered, order = probs.sort(descending=True)
            keep = (torch.arange(len(ordered)) < top_k) & (ordered.cumsum(0) - ordered <= top_p)
            kept = torch.where(keep, ordered, torch.zeros_like(ordered))
            rows.append(torch.zeros_like(probs).scatter(0, order, kept / kept.sum()))
    return torch.stack(rows)


def test_top_k_with_top_p_is_refused_unless_accepted_and_differs_from_generate(peaked_sglang):
    """SGLang takes the nucleus of the whole distribution within the top-k, ``generate`` the nucleus of the top-k's
    renormalised mass: refused by default; accepted (``joint_top_k_top_p``), SGLang's samples follow SGLang's rule
    (the check against the exact joint distribution passes) and fail the check against ``generate``."""
    path, tokenizer, prompts, engine, _ = peaked_sglang
    ref = reference(path, tokenizer, prompts, temperature=1.0, top_p=0.8, top_k=8)
    with pytest.raises(ConfigError, match=r"--engine.joint_top_k_top_p true accepts SGLang's rule"):
        engine.generate(prompts, ref.params)
    engine.joint_top_k_top_p = True
    try:
        replies = _replies(engine, prompts, ref.params)
    finally:
        engine.joint_top_k_top_p = False
    figures = measure(replies, ref)
    assert figures["tv_engine_exact"] > figures["tv_one_sample_threshold"]
    joint = joint_first_token(path, prompts, temperature=1.0, top_k=8, top_p=0.8)
    distance = mean_tv(first_token_counts(replies, joint.shape[1]), joint)
    threshold = null_quantile(joint, DRAWS, two_sample=False)
    print(f"top-k 8 with top-p 0.8: distance to generate's exact {figures['tv_engine_exact']:.4f} (threshold "
          f"{figures['tv_one_sample_threshold']:.4f}), to SGLang's rule {distance:.4f} (threshold {threshold:.4f})")
    assert distance <= threshold


def test_detects_a_wrong_temperature(peaked_sglang):
    """The check can fail: SGLang's samples at temperature 1.15 are told apart from the distribution at 1.0."""
    path, tokenizer, prompts, engine, _ = peaked_sglang
    exact = exact_at_temperature_one(path, tokenizer, prompts)
    distance, threshold = wrong_temperature_distance(_replies(engine, prompts, wrong_temperature_params()), exact)
    print(f"temperature x1.15: first-token distance {distance:.4f}, threshold {threshold:.4f}")
    assert distance > threshold


def test_the_checkpoints_sampling_values_are_named(peaked_sglang):
    """The checkpoint's generation config sets Qwen2.5-Instruct's sampling values (``CHECKPOINT_SAMPLING``):
    ``setup`` names them in a warning. That SGLang does not apply them is what the comparisons with ``generate``
    show (TRL's configuration overrides each of them)."""
    *_, warnings = peaked_sglang
    assert ignored_values_named(warnings), warnings
