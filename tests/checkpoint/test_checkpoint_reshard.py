"""A checkpoint written by 2 ranks loads on 1, and one written by 1 loads on 2 (gloo, CPU)."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import spawn
from lightning_fabric import Fabric

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.checkpoint import CheckpointManager, latest_checkpoint
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import make_batch, set_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _setup(fabric, model_dir):
    backend = TorchBackend(lr=1e-2)
    backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    group = dist.new_group(backend="gloo") if fabric.world_size > 1 else None
    manager = CheckpointManager(os.path.join(os.path.dirname(model_dir), "ckpt"), rank=fabric.global_rank,
                                world_size=fabric.world_size, barrier=fabric.barrier, process_group=group)
    return backend, manager


def _train_step(backend, rank):
    batch = make_batch([1.0, 0.0, 0.3, 0.9], [0, 0, 1, 1], length=6)
    batch.input_ids = torch.randint(4, 50, batch.input_ids.shape, generator=torch.Generator().manual_seed(rank))
    batch.advantages = GRPO(kl_coef=0.0).advantages(batch)
    backend.train(batch, set_up(GRPO(kl_coef=0.0), 5))


def _save_on_two(fabric, model_dir):
    backend, manager = _setup(fabric, model_dir)
    _train_step(backend, fabric.global_rank)  # different data per rank, one all-reduced update
    manager.save(1, backend.state_dict(), {"step": 1}, {"rank": fabric.global_rank})
    manager.wait()
    if fabric.global_rank == 0:
        torch.save(dict(backend.named_weights()), os.path.join(os.path.dirname(model_dir), "expected.pt"))


def _load_on_two(fabric, model_dir):
    backend, manager = _setup(fabric, model_dir)
    state = backend.state_dict()
    trainer_state, rank_state = manager.load(latest_checkpoint(manager.root), state)
    backend.load_state_dict(state)
    expected = torch.load(os.path.join(os.path.dirname(model_dir), "expected.pt"))
    assert trainer_state["world_size"] == 1
    assert rank_state == ({"rank": 0} if fabric.global_rank == 0 else None)  # rank 1 did not exist then
    for name, tensor in backend.named_weights():
        assert torch.equal(tensor, expected[name]), name
    _train_step(backend, fabric.global_rank)  # training goes on from there



def _model(tmp_path):
    return materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(), 0,
                       str(tmp_path / "model"))


def test_two_ranks_to_one(tmp_path):
    model_dir = _model(tmp_path)
    spawn(2, _save_on_two, model_dir)
    backend, manager = _setup(Fabric(accelerator="cpu", devices=1), model_dir)
    state = backend.state_dict()
    trainer_state, rank_state = manager.load(latest_checkpoint(manager.root), state)
    backend.load_state_dict(state)
    expected = torch.load(tmp_path / "expected.pt")
    for name, tensor in backend.named_weights():
        assert torch.equal(tensor, expected[name]), name
    assert trainer_state["step"] == 1 and trainer_state["world_size"] == 2
    assert rank_state == {"rank": 0}  # rank 0's own state; rank 1's is not this rank's to take
    assert any(len(s) for s in backend.optimizer.optimizer.state.values())  # Adam moments came back


def test_one_rank_to_two(tmp_path):
    model_dir = _model(tmp_path)
    backend, manager = _setup(Fabric(accelerator="cpu", devices=1), model_dir)
    _train_step(backend, 0)
    manager.save(1, backend.state_dict(), {"step": 1}, {"rank": 0}, asynchronous=False)
    torch.save(dict(backend.named_weights()), tmp_path / "expected.pt")
    spawn(2, _load_on_two, model_dir)
