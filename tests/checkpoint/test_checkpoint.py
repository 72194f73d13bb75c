"""Checkpoints: exact round trip, atomicity, corruption detection, retention, resharding."""

import json
import os

import pytest
import torch
from lightning_fabric import Fabric

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.checkpoint import CheckpointError, CheckpointManager, latest_checkpoint, resolve_resume, verify
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import make_batch, set_up


def _backend(tmp_path, seed=0):
    return _backend_and_path(tmp_path, seed)[0]


def _backend_and_path(tmp_path, seed=0):
    path = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(),
                       seed, str(tmp_path / f"model{seed}"))
    backend = TorchBackend(lr=1e-2, warmup_steps=3)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=True)
    return backend, path


def _train_once(backend):
    batch = make_batch([1.0, 0.0, 0.5, 0.2], [0, 0, 1, 1], length=6)
    batch.input_ids = torch.randint(4, 50, batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    batch.advantages = GRPO(kl_coef=0.0).advantages(batch)
    backend.train(batch, set_up(GRPO(kl_coef=0.0), 5))


@pytest.mark.parametrize("asynchronous", [True, False])
def test_round_trip_restores_weights_optimizer_and_schedule(tmp_path, asynchronous):
    backend = _backend(tmp_path)
    _train_once(backend)
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    stall = manager.save(1, backend.state_dict(), {"step": 1, "sampler": {"epoch": 0, "position": 16}},
                         {"rng": torch.get_rng_state()}, asynchronous=asynchronous)
    assert stall >= 0
    manager.wait()
    path = latest_checkpoint(str(tmp_path / "ckpt"))
    assert path.endswith("step_00000001") and verify(path)["world_size"] == 1

    other = _backend(tmp_path, seed=1)  # different weights, fresh optimizer
    state = other.state_dict()
    trainer_state, rank_state = manager.load(path, state)
    other.load_state_dict(state)
    assert trainer_state["sampler"]["position"] == 16 and "rng" in rank_state
    for (name, a), (_, b) in zip(backend.named_weights(), other.named_weights(), strict=False):
        assert torch.equal(a, b), name
    assert other.scheduler.last_epoch == backend.scheduler.last_epoch
    # continuing from the checkpoint gives exactly the same next update
    _train_once(backend)
    _train_once(other)
    for (name, a), (_, b) in zip(backend.named_weights(), other.named_weights(), strict=False):
        assert torch.equal(a, b), name


def test_crash_mid_save_leaves_previous_checkpoint_latest(tmp_path):
    backend = _backend(tmp_path)
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(1, backend.state_dict(), {"step": 1}, {}, asynchronous=False)
    os.makedirs(tmp_path / "ckpt" / "step_00000002.tmp")  # what a kill during a save leaves
    (tmp_path / "ckpt" / "step_00000002.tmp" / "__0_0.distcp").write_bytes(b"half")
    assert latest_checkpoint(str(tmp_path / "ckpt")).endswith("step_00000001")
    assert resolve_resume("auto", str(tmp_path / "ckpt")).endswith("step_00000001")
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        resolve_resume(str(tmp_path / "ckpt" / "step_00000002.tmp"), str(tmp_path))
    manager.save(3, backend.state_dict(), {"step": 3}, {}, asynchronous=False)
    assert not (tmp_path / "ckpt" / "step_00000002.tmp").exists()  # leftovers are cleaned up


def test_keeps_only_the_last_k(tmp_path):
    backend = _backend(tmp_path)
    manager = CheckpointManager(str(tmp_path / "ckpt"), keep_last=2)
    for step in range(1, 5):
        manager.save(step, backend.state_dict(), {"step": step}, {})
    manager.wait()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000003", "step_00000004"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_corruption_is_detected_and_named(tmp_path, damage):
    backend = _backend(tmp_path)
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(1, backend.state_dict(), {"step": 1}, {}, asynchronous=False)
    path = latest_checkpoint(str(tmp_path / "ckpt"))
    data = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    target = os.path.join(path, data)
    if damage == "truncate":
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
        message = f"{data}: truncated or corrupted"
    elif damage == "flip":
        raw = bytearray(open(target, "rb").read())
        raw[len(raw) // 2] ^= 0xFF
        open(target, "wb").write(bytes(raw))
        message = f"{data}: corrupted \\(SHA-256"
    elif damage == "delete":
        os.remove(target)
        message = f"{data}: missing"
    else:
        open(os.path.join(path, "manifest.json"), "w").write("{not json")
        message = "manifest.json: corrupted manifest"
    with pytest.raises(CheckpointError, match=message):
        manager.load(path, backend.state_dict())


def test_manifest_lists_every_file(tmp_path):
    backend = _backend(tmp_path)
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(7, backend.state_dict(), {"step": 7}, {}, asynchronous=False)
    path = latest_checkpoint(str(tmp_path / "ckpt"))
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert set(manifest["files"]) >= set(os.listdir(path)) - {"manifest.json"}
    assert manifest["step"] == 7


@pytest.mark.integration
def test_export_to_hf(tmp_path):
    from conftest import run_gcore_here  # gcore export through the CLI's main, in this process
    from transformers import AutoModelForCausalLM

    backend, model_dir = _backend_and_path(tmp_path)
    _train_once(backend)
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(2, backend.state_dict(), {"step": 2}, {}, hf_files=model_dir)
    manager.wait()
    path = latest_checkpoint(str(tmp_path / "ckpt"))
    assert "hf/config.json" in verify(path)["files"]
    result = run_gcore_here("export", path, "--to", "hf", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in backend.named_weights():
        assert torch.equal(exported.state_dict()[name], tensor), name
    bad = run_gcore_here("export", path, "--to", "onnx", str(tmp_path / "x"))
    assert bad.returncode == 2 and "valid formats: hf" in bad.stderr
