"""LoRA on the torch backend (``--backend.lora_rank``): only the adapters train, the engines get merged weights
under the base names, checkpoints resume exactly, the final export is a plain HF checkpoint, bad options fail
in one line."""

import csv
import os
import subprocess
import sys

import pytest
import torch
from conftest import FAST, engine_logprob_gap, varied_reward
from lightning_fabric import Fabric

from gcore import GRPO, HFEngine, ModelConfig, SamplingParams, TorchBackend
from gcore.algorithms.base import group_normalize
from gcore.errors import ConfigError
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import set_up

pytest.importorskip("peft", reason="needs peft: pip install gcore[lora]")


def _model(tmp_path):
    tokenizer = char_tokenizer()
    config = ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    return materialize(config, tokenizer, seed=0, workdir=str(tmp_path / "model")), tokenizer


def _backend(path, **lora):
    backend = TorchBackend(lr=1e-2, **lora)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=True)
    return backend


def _train_step(backend, batch, params):
    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 3
    batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
    return backend.train(batch, set_up(GRPO(kl_coef=0.0), params.max_new_tokens))


def test_only_adapters_train_and_the_engine_matches_the_merged_weights(tmp_path):
    torch.manual_seed(0)
    path, tokenizer = _model(tmp_path)
    backend = _backend(path, lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    trained = {n for n, p in backend.hf_model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert {id(p) for g in backend.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in backend.hf_model.named_parameters() if n in trained}
    # q_proj and v_proj are adapted; their attention block's other projections go along (engines fuse q, k and
    # v into one tensor); the MLP, norms and embeddings are not sent
    sent = dict(backend.named_weights())
    assert {n.rsplit(".", 2)[-2] for n in sent} == {"q_proj", "k_proj", "v_proj", "o_proj"}

    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    params = SamplingParams(n=4, max_new_tokens=8, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,))
    gap, batch = engine_logprob_gap(engine, backend, tokenizer, params)
    assert gap < 1e-4  # B starts at zero: the adapted model is the checkpoint

    before = {k: v.clone() for k, v in backend.hf_model.state_dict().items()}
    for _ in range(2):  # the first step moves only B (A's gradient is B^T dL/dW = 0); the second moves A too
        _train_step(backend, batch, params)
    after = backend.hf_model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in before if ".lora_" in k}

    stale, _ = engine_logprob_gap(engine, backend, tokenizer, params)
    assert stale > 1e-3  # the adapters moved the policy; the engine has not been told yet
    received = engine.update_weights(backend.named_weights())
    full = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
    assert received == sum(t.numel() * t.element_size() for _, t in backend.named_weights()) < full
    gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
    assert gap < 1e-4  # float32, the bound of test_weight_sync.py

    # the export is a plain HF checkpoint (no adapter tensors) that an engine loads with the same logprobs
    backend.save_pretrained(str(tmp_path / "final"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert not any("lora" in k or "base_layer" in k for k in saved)
    reloaded = HFEngine()
    reloaded.setup(ModelSource(str(tmp_path / "final")), torch.device("cpu"))
    assert set(reloaded.model.state_dict()) == set(engine.model.state_dict())
    for name, tensor in engine.model.state_dict().items():
        torch.testing.assert_close(reloaded.model.state_dict()[name], tensor, rtol=0, atol=1e-6)


def test_rank_zero_is_the_plain_backend(tmp_path):
    path, _ = _model(tmp_path)
    backend = _backend(path)
    assert all(p.requires_grad for p in backend.hf_model.parameters())
    assert dict(backend.named_weights()).keys() == backend.hf_model.state_dict().keys()


def _rows(root):
    with open(os.path.join(root, "gcore", "version_0", "metrics.csv")) as f:
        return list(csv.DictReader(f))


def _fit(root, *args):
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", str(root), *FAST,
           "--sampling.n", "4",
           "--backend.lora_rank", "4", "--backend.lr", "1e-2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a fixed thread count: the resumed steps are compared bit for bit
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.integration
def test_lora_checkpoint_resumes_exactly_and_exports_a_plain_checkpoint(tmp_path):
    whole = _fit(tmp_path, "--trainer.max_steps", "4", "--trainer.checkpoint_every", "2")
    assert whole.returncode == 0, whole.stderr
    first = _rows(tmp_path)
    ckpt = tmp_path / "gcore" / "checkpoints" / "step_00000001"
    resumed = _fit(tmp_path, "--trainer.max_steps", "4", "--trainer.resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 2" in resumed.stdout
    second = _rows(tmp_path)
    assert [r["step"] for r in second] == ["0", "1", "2", "3"]
    for before, after in zip(first[2:], second[2:], strict=True):
        for key in ("reward/mean", "loss", "grad_norm", "response_length/mean"):
            assert before[key] == after[key], (key, before["step"])
    assert any(float(r["grad_norm"]) > 0 for r in first[2:])  # the resumed steps trained the adapters
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gcore" / "version_0" / "final"))
    assert not any("lora" in k for k in final.state_dict())


@pytest.mark.parametrize("options, message", [
    (dict(lora_rank=-1), "--backend.lora_rank -1: must be an integer >= 0"),
    (dict(lora_rank=4, lora_alpha=0), "--backend.lora_alpha 0: must be an integer > 0"),
    (dict(lora_rank=4, lora_target_modules=[]), "--backend.lora_target_modules []: must be a non-empty list"),
    (dict(lora_rank=4, strategy="fsdp"), "--backend.lora_rank 4 does not support --backend.strategy fsdp"),
])
def test_bad_options_fail_in_one_line(options, message):
    with pytest.raises(ConfigError) as err:
        TorchBackend(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_target_that_matches_nothing_lists_the_linear_modules(tmp_path):
    path, _ = _model(tmp_path)
    with pytest.raises(ConfigError) as err:
        _backend(path, lora_rank=4, lora_target_modules=["q_proj", "qkv"])
    assert str(err.value) == ("--backend.lora_target_modules: 'qkv' matches no linear module of the model; its linear "
                              "modules: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj")


@pytest.mark.integration
def test_the_cli_refuses_lora_on_megatron(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", str(tmp_path), *FAST,
                             "--backend", "megatron", "--backend.lora_rank", "4"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "lora_rank" in result.stderr


def test_gradient_checkpointing_trains_the_adapters(tmp_path):
    torch.manual_seed(0)
    path, tokenizer = _model(tmp_path)
    backend = TorchBackend(lr=1e-2, lora_rank=4, gradient_checkpointing=True)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=True)
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    params = SamplingParams(n=4, max_new_tokens=8, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,))
    _, batch = engine_logprob_gap(engine, backend, tokenizer, params)
    before = {k: v.clone() for k, v in backend.hf_model.state_dict().items() if "lora_B" in k}
    metrics = _train_step(backend, batch, params)
    assert metrics["grad_norm"] > 0
    after = backend.hf_model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every adapter got a gradient


@pytest.mark.integration
def test_lora_on_engine_workers_and_two_ranks(tmp_path):
    """Two DDP ranks train the adapters; the engine workers (``--placement dynamic``) get the partial merged
    sync through shared memory, and a worker that loads later takes the checkpoint plus that sync."""
    # a reward that varies within every group (the tiny random model rarely answers the task): gradients each step
    result = _fit(tmp_path, "--trainer.max_steps", "3", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
                  "--placement", "dynamic", *varied_reward(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = _rows(tmp_path)
    assert len(rows) == 3 and all(float(r["grad_norm"]) > 0 for r in rows)
    assert all(0 < float(r["sync/gb"]) for r in rows)
