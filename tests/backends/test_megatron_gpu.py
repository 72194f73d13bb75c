"""GPU-marked megatron backend tests: a Qwen2.5-0.5B-shaped model (random weights), Transformer
Engine's layer spec when importable. Skipped without CUDA (conftest) or without megatron-core.

Tolerances: log-probabilities within 2e-3 of the HF model's in float32 (GPU matmuls may use TF32
and other kernels than the CPU's); after one AdamW step the weights within 1e-4 of the torch
backend's (lr 1e-5: a step moves a weight by about 1e-5, so this checks the direction coarsely and
the magnitude of gross errors).
"""

import os

import pytest
import torch
from conftest import spawn
from lightning_fabric import Fabric

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import make_batch, set_up

pytestmark = pytest.mark.gpu

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, max_position_embeddings=4096)



def _model_dir(tmp_path, **shape):
    return materialize(ModelConfig(**shape), char_tokenizer(), 0, str(tmp_path / "model"))


def _batch(rank):
    batch = make_batch([1.0, 0.0, 0.3, 0.9], [0, 0, 1, 1], length=24)
    batch.input_ids = torch.randint(4, 100, batch.input_ids.shape, generator=torch.Generator().manual_seed(rank))
    batch.advantages = GRPO(kl_coef=0.0).advantages(batch)
    return batch


@pytest.mark.parametrize("transformer_engine", ["false", "auto"])
def test_logprobs_match_hf_on_gpu(tmp_path, transformer_engine):
    pytest.importorskip("megatron.core")
    from transformers import AutoModelForCausalLM

    from gcore.backends import token_logprobs
    from gcore.backends.megatron import MegatronBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = _model_dir(tmp_path, **QWEN25_05B)
    backend = MegatronBackend(transformer_engine=transformer_engine)
    backend.setup(Fabric(accelerator="cuda", devices=1), ModelSource(model_dir), GRPO(kl_coef=0.0),
                  embedded=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).cuda()
    ids = torch.randint(4, 100, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        ours, _ = backend.forward.logprobs(backend.policy, ids, 1.0)
        theirs, _ = token_logprobs(hf(input_ids=ids).logits, ids, 1.0)
    assert (ours - theirs).abs().max() < 2e-3
    for name, tensor in backend.named_weights():
        assert torch.equal(tensor.cpu(), hf.state_dict()[name].cpu()), name


def _compare(fabric, model_dir, tp, out, pp=1, distributed_optimizer=None):
    from gcore.backends.megatron import MegatronBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    batch = _batch(fabric.global_rank)
    reference = TorchBackend(lr=1e-5)
    reference.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    ref_metrics = reference.train(batch, set_up(GRPO(kl_coef=0.0), 23))
    ref_weights = {k: v.cpu() for k, v in reference.named_weights()}
    backend = MegatronBackend(tensor_parallel_size=tp, pipeline_parallel_size=pp, lr=1e-5,
                              distributed_optimizer=distributed_optimizer)
    backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    metrics = backend.train(batch, set_up(GRPO(kl_coef=0.0), 23))
    weights = {k: v.cpu() for k, v in backend.named_weights()}
    torch.save({"loss": abs(metrics["loss"] - ref_metrics["loss"]),
                "weights": max(float((weights[k] - v).abs().max()) for k, v in ref_weights.items())},
               f"{out}.{fabric.global_rank}")


@pytest.mark.integration
@pytest.mark.parametrize("tp", [1, 2])
def test_train_step_matches_torch_on_gpus(tmp_path, tp):
    pytest.importorskip("megatron.core")
    devices = 2
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} GPUs")
    model_dir = _model_dir(tmp_path, **{**QWEN25_05B, "num_hidden_layers": 4})
    out = str(tmp_path / "result")
    spawn(devices, _compare, model_dir, tp, out, accelerator="cuda")
    for rank in range(devices):
        result = torch.load(f"{out}.{rank}")
        assert result["loss"] < 1e-4 and result["weights"] < 1e-4, result


@pytest.mark.integration
@pytest.mark.parametrize(("pp", "distributed_optimizer"), [(1, True), (2, None)])
def test_distributed_optimizer_and_pipeline_on_gpus(tmp_path, pp, distributed_optimizer):
    """megatron's own CUDA paths (no CPU adaptation): the distributed optimizer (forced on at DP=1 on
    one GPU, DP=2 on two) and two pipeline stages, each equal to the torch backend's step."""
    pytest.importorskip("megatron.core")
    devices = 2 if pp == 2 or torch.cuda.device_count() >= 2 else 1
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} GPUs")
    model_dir = _model_dir(tmp_path, **{**QWEN25_05B, "num_hidden_layers": 4})
    out = str(tmp_path / "result")
    args = (model_dir, 1, out, pp, distributed_optimizer)
    if devices > 1:  # spawned ranks that leave together, as in every other multi-rank test
        spawn(devices, _compare, *args, accelerator="cuda")
    else:
        Fabric(accelerator="cuda", devices=1).launch(_compare, *args)
    for rank in range(devices):
        result = torch.load(f"{out}.{rank}")
        assert result["loss"] < 1e-4 and result["weights"] < 1e-4, result


def test_grpo_fit_with_megatron_on_gpu(tmp_path):
    pytest.importorskip("megatron.core")
    from gcore import Trainer, TrainerConfig
    from gcore.backends.megatron import MegatronBackend

    result = Trainer(
        trainer=TrainerConfig(max_steps=30, accelerator="cuda", default_root_dir=str(tmp_path),
                              enable_progress_bar=False),
        backend=MegatronBackend(),
    ).fit()
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-5:]) / 5 > 3 * sum(rewards[:5]) / 5, rewards
    assert os.path.isdir(result.final_model_dir)
