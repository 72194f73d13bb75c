"""``--backend.strategy fsdp`` for the torch backend: FSDP2 under Fabric's ModelParallelStrategy.

Fabric's FSDPStrategy (FSDP1) refuses the CPU accelerator; the backend uses ModelParallelStrategy with
torch's ``fully_shard`` instead, which runs on CPU (gloo) and GPU. The fast tests here check the
choices and errors and one single-rank step (FSDP over a mesh of one: the same update as plain
training, the code path of the sharded one); tests/backends/test_fsdp_cpu.py compares FSDP with DDP on two
gloo ranks, and the GPU-marked tests below do it on CUDA.

Tolerance: weights within 1e-5 after one AdamW step at lr 1e-3 (TF32 off on GPU).
"""

import os
from datetime import timedelta

import pytest
import torch
from lightning_fabric import Fabric

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.errors import ConfigError
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import make_batch, set_up


def test_fsdp_is_model_parallel_strategy_on_cpu_and_ddp_the_default():
    from lightning_fabric.strategies import DDPStrategy, ModelParallelStrategy

    timeout = timedelta(seconds=7)  # --trainer.collective_timeout, given to the strategy the backend builds
    fsdp = TorchBackend(strategy="fsdp").strategy(2, "cpu", timeout)
    ddp = TorchBackend().strategy(2, "cpu", timeout)  # DDP stays the default
    assert isinstance(fsdp, ModelParallelStrategy) and isinstance(ddp, DDPStrategy)
    assert fsdp._timeout == ddp._timeout == timeout  # Fabric keeps the constructor's timeout there
    assert TorchBackend().strategy(1, "cpu") == "auto"


def test_unknown_strategy_names_the_choices():
    with pytest.raises(ConfigError, match="--backend.strategy 'zero3': valid choices: ddp, fsdp"):
        TorchBackend(strategy="zero3")


def test_fsdp_with_sequence_parallelism_is_a_one_line_error():
    with pytest.raises(ConfigError, match="--backend.strategy fsdp does not support "
                                          "--backend.sequence_parallel_size 2.*use --backend.strategy ddp"):
        TorchBackend(strategy="fsdp", sequence_parallel_size=2)


@pytest.mark.integration
def test_cli_fsdp_with_sequence_parallelism_fails_with_the_message(gcore_cli):
    run = gcore_cli("--backend.strategy", "fsdp", "--backend.sequence_parallel_size", "2")
    assert run.returncode != 0
    assert "--backend.strategy fsdp does not support --backend.sequence_parallel_size 2" in run.stderr


# GPU ------------------------------------------------------------------------------------------


def _model_dir(tmp_path):
    return materialize(ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128), char_tokenizer(), 0,
                       os.path.join(str(tmp_path), "model"))


def _step(strategy, model_dir, accelerator="cuda"):
    backend = TorchBackend(lr=1e-3, micro_batch_size=2, strategy=strategy)
    fabric = Fabric(accelerator=accelerator, devices=1, strategy=backend.strategy(1, accelerator))
    fabric.launch()  # ModelParallelStrategy wants it, even for one process
    backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    batch = make_batch([1.0, 0.0, 0.3, 0.9], [0, 0, 1, 1], length=12)
    batch.input_ids = torch.randint(4, 100, batch.input_ids.shape, generator=torch.Generator().manual_seed(0))
    batch.advantages = GRPO(kl_coef=0.0).advantages(batch)
    metrics = backend.train(batch, set_up(GRPO(kl_coef=0.0), 8))
    weights = {k: v.detach().cpu().clone() for k, v in backend.named_weights()}
    return backend, metrics, weights


@pytest.fixture
def _one_rank_group(monkeypatch):
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    yield
    if torch.distributed.is_initialized():  # the FSDP step's group of one: leave none behind for other tests
        torch.distributed.destroy_process_group()


def _check_step_matches_ddp(tmp_path, accelerator):
    model_dir = _model_dir(tmp_path)
    _, ddp_metrics, ddp_weights = _step("ddp", model_dir, accelerator)
    backend, fsdp_metrics, fsdp_weights = _step("fsdp", model_dir, accelerator)
    assert sorted(fsdp_weights) == sorted(ddp_weights)
    assert abs(fsdp_metrics["loss"] - ddp_metrics["loss"]) < 1e-5
    assert abs(fsdp_metrics["grad_norm"] - ddp_metrics["grad_norm"]) < 1e-5 * ddp_metrics["grad_norm"]
    for name, tensor in ddp_weights.items():
        assert (fsdp_weights[name] - tensor).abs().max() < 1e-5, name
    backend.save_pretrained(str(tmp_path / "saved"))  # the synced full weights as an HF checkpoint
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved")).state_dict()
    for name, tensor in saved.items():
        assert torch.equal(tensor, fsdp_weights[name]), name


def test_fsdp_step_matches_ddp_on_one_cpu_rank(tmp_path, _one_rank_group):
    _check_step_matches_ddp(tmp_path, "cpu")


@pytest.mark.gpu
def test_fsdp_step_matches_ddp_on_gpu(tmp_path, _one_rank_group):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_step_matches_ddp(tmp_path, "cuda")


@pytest.mark.integration
@pytest.mark.gpu
@pytest.mark.slow
def test_cli_fit_under_fsdp_on_all_gpus(gcore_cli, tmp_path):
    devices = str(min(2, torch.cuda.device_count()))
    run = gcore_cli("--backend.strategy", "fsdp", "--trainer.accelerator", "cuda", "--trainer.devices", devices,
                    "--trainer.checkpoint_every", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert next((tmp_path / "runs").rglob("final"))


def test_checkpoints_get_a_gloo_group_in_a_one_rank_process_group(tmp_path, _one_rank_group):
    """One GPU under FSDP runs in a one-rank (NCCL) process group, and DCP's asynchronous save needs a CPU backend:
    whenever a process group exists, checkpoints get a gloo group of their own (found on an H100, BENCHMARKS.md)."""
    from types import SimpleNamespace

    from gcore.checkpointer import Checkpointer

    fabric = SimpleNamespace(world_size=1, global_rank=0, barrier=lambda: None)

    def files():
        checkpointer = Checkpointer(str(tmp_path / "ckpt"), every=1, keep=1, asynchronous=True, resume=None, seed=0,
                                    signature={}, collective_timeout=60.0)
        checkpointer.setup(fabric, backend=None, shared={}, own={})
        return checkpointer.files

    assert files().process_group is None  # no process group: nothing to add
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    group = files().process_group
    assert group is not None and torch.distributed.get_backend(group) == "gloo"
