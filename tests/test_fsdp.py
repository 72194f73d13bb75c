"""``--backend.strategy fsdp`` for the torch backend: Fabric's FSDPStrategy, GPU only.

Lightning (2.6.6, the pinned version) refuses FSDP on the CPU accelerator, so on CPU the option
stops with a one-line ConfigError before any process starts; the CPU tests check that message and
that Lightning still refuses (so the message does not outlive its reason). The GPU-marked tests
compare one FSDP step with one DDP step on the same batch and run the CLI under FSDP.

Tolerance (GPU): weights within 1e-5 after one AdamW step at lr 1e-3 (FSDP reduces flattened
gradients in another order than DDP's buckets; TF32 off).
"""

import os

import pytest
import torch
from lightning.fabric import Fabric

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.errors import ConfigError
from gcore.model import char_tokenizer, materialize
from gcore.testing import make_batch


def test_fsdp_on_cpu_is_a_one_line_error():
    with pytest.raises(ConfigError, match="--backend.strategy fsdp needs CUDA GPUs.*use --backend.strategy ddp"):
        TorchBackend(strategy="fsdp").strategy(2, "cpu")
    assert TorchBackend().strategy(2, "cpu") == "ddp"  # DDP stays the default


def test_unknown_strategy_names_the_choices():
    with pytest.raises(ConfigError, match="--backend.strategy 'zero3': valid choices: ddp, fsdp"):
        TorchBackend(strategy="zero3")


def test_lightning_still_refuses_fsdp_on_cpu():
    """The reason for the CPU error: if a Lightning upgrade lifts it, this fails and the error should go."""
    with pytest.raises(ValueError, match="FSDP is only available on GPU"):
        Fabric(accelerator="cpu", devices=2, strategy="fsdp")


def test_cli_fsdp_on_cpu_fails_with_the_message(gcore_cli):
    run = gcore_cli("--backend.strategy", "fsdp", "--trainer.accelerator", "cpu", "--trainer.devices", "2")
    assert run.returncode != 0
    assert "--backend.strategy fsdp needs CUDA GPUs" in run.stderr


# GPU ------------------------------------------------------------------------------------------


def _model_dir(tmp_path):
    return materialize(ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128), char_tokenizer(), 0,
                       os.path.join(str(tmp_path), "model"))


def _step(strategy, model_dir):
    backend = TorchBackend(lr=1e-3, micro_batch_size=2, strategy=strategy)
    fabric = Fabric(accelerator="cuda", devices=1, strategy=backend.strategy(1, "cuda"))
    backend.setup(fabric, model_dir, torch.float32, False, GRPO(kl_coef=0.0), embedded=True)
    batch = make_batch([1.0, 0.0, 0.3, 0.9], [0, 0, 1, 1], length=12)
    batch.input_ids = torch.randint(4, 100, batch.input_ids.shape, generator=torch.Generator().manual_seed(0))
    batch.advantages = GRPO(kl_coef=0.0).advantages(batch)
    metrics = backend.train(batch, GRPO(kl_coef=0.0), max_new_tokens=8)
    weights = {k: v.detach().cpu().clone() for k, v in backend.named_weights()}
    return backend, metrics, weights


@pytest.mark.gpu
def test_fsdp_step_matches_ddp_on_gpu(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = _model_dir(tmp_path)
    _, ddp_metrics, ddp_weights = _step("ddp", model_dir)
    backend, fsdp_metrics, fsdp_weights = _step("fsdp", model_dir)
    assert sorted(fsdp_weights) == sorted(ddp_weights)
    assert abs(fsdp_metrics["loss"] - ddp_metrics["loss"]) < 1e-5
    for name, tensor in ddp_weights.items():
        assert (fsdp_weights[name] - tensor).abs().max() < 1e-5, name
    backend.save_pretrained(str(tmp_path / "saved"))  # the synced full weights as an HF checkpoint
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved")).state_dict()
    for name, tensor in saved.items():
        assert torch.equal(tensor, fsdp_weights[name]), name


@pytest.mark.gpu
@pytest.mark.slow
def test_cli_fit_under_fsdp_on_all_gpus(gcore_cli, tmp_path):
    devices = str(min(2, torch.cuda.device_count()))
    run = gcore_cli("--backend.strategy", "fsdp", "--trainer.accelerator", "cuda", "--trainer.devices", devices,
                    "--trainer.checkpoint_every", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert next((tmp_path / "runs").rglob("final"))
