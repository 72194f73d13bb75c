"""The engine's log-probabilities equal the trainer's after every weight sync."""

import pytest
import torch
from lightning_fabric import Fabric

from gcore import GRPO, HFEngine, ModelConfig, Prompt, Sample, SamplingParams, TorchBackend
from gcore.algorithms.base import group_normalize
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import set_up
from gcore.types import collate


def _samples(engine, tokenizer, prompts, params):
    out = engine.generate([p.token_ids for p in prompts], params)
    return [
        Sample(p, i, g.token_ids, g.logprobs, tokenizer.decode(g.token_ids), g.finished)
        for i, (p, gens) in enumerate(zip(prompts, out, strict=False))
        for g in gens
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_engine_matches_trainer_after_sync(tmp_path, device):
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    config = ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    path = materialize(config, tokenizer, seed=0, workdir=str(tmp_path / "model"))
    fabric = Fabric(accelerator=device, devices=1)
    backend, engine, algorithm = TorchBackend(lr=1e-2), HFEngine(), GRPO(kl_coef=0.0)  # no reference model here
    backend.setup(fabric, ModelSource(path), algorithm, embedded=True)
    engine.setup(ModelSource(path), fabric.device)
    params = SamplingParams(n=4, max_new_tokens=8, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,))
    prompts = [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"]) for i in range(3)]

    def max_gap(samples):
        batch = collate(samples, tokenizer.pad_token_id, params.temperature)
        trainer_logprobs = backend.compute_logprobs(batch, "policy")
        return float(((trainer_logprobs - batch.engine_logprobs) * batch.response_mask).abs().max()), batch

    gap, batch = max_gap(_samples(engine, tokenizer, prompts, params))
    assert gap < 1e-4  # same weights at start

    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 3
    batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
    backend.train(batch, set_up(algorithm, params.max_new_tokens))

    stale, _ = max_gap(_samples(engine, tokenizer, prompts, params))
    assert stale > 1e-3  # the trainer moved; the engine has not been told yet

    received = engine.update_weights(backend.named_weights())
    assert received == sum(t.numel() * t.element_size() for _, t in backend.named_weights())
    gap, _ = max_gap(_samples(engine, tokenizer, prompts, params))
    assert gap < 1e-4


def test_sync_rejects_unknown_or_misshapen_weights(tmp_path):
    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), tokenizer, 0,
                       str(tmp_path / "m"))
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    from gcore.errors import ConfigError

    with pytest.raises(ConfigError, match="no parameter named 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ConfigError, match="shape mismatch for 'model.norm.weight'"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
