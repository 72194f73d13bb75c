"""A training step with sequence parallelism (2 gloo ranks, one group of K=2) gives the same update as
one rank without it, on the same batch.

Tolerance: weights after one AdamW step (lr 1e-2) within atol 2e-5 (0.2% of a step: the split
reorders float32 sums, and Adam's normalisation amplifies that where a gradient is near 0);
loss, entropy and gradient norm within rel 1e-4.
"""

import pytest
import torch
from lightning.fabric import Fabric

from gcore import GRPO, PPO, ModelConfig, TorchBackend
from gcore.model import char_tokenizer, materialize
from gcore.testing import make_batch

pytestmark = pytest.mark.slow

WEIGHT_ATOL = 2e-5
METRIC_REL = 1e-4


def _batch(algorithm):  # noqa: ANN001, ANN202
    """7 rows of length 7 (odd: not divisible by the 2 ranks), two of them shorter; deterministic."""
    batch = make_batch([1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.3], [0, 0, 1, 1, 2, 2, 2], length=7)
    batch.input_ids = torch.randint(4, 60, batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
    batch.attention_mask[1, 5:] = 0
    batch.response_mask[1, 4:] = 0
    batch.attention_mask[4, 6:] = 0
    batch.response_mask[4, 5:] = 0
    if algorithm.needs_critic:  # PPO: values of a fixed (untrained) critic, so advantages are the same everywhere
        batch.values = torch.linspace(-0.5, 0.5, batch.response_mask.numel()).view_as(batch.response_mask)
        batch.values = batch.values * batch.response_mask
    batch.advantages = algorithm.advantages(batch)
    return batch


def _algorithm(name):  # noqa: ANN001, ANN202
    if name == "ppo":  # one epoch, one mini-batch: old logprobs are the current ones (no extra pass)
        return PPO(epochs=1, mini_batches=1, whiten_advantages=False)
    return GRPO(kl_coef=0.0)


def _train(fabric, model_dir, rows, out, algorithm_name, sp_size, mode, packing):  # noqa: ANN001, ANN202
    algorithm = _algorithm(algorithm_name)
    backend = TorchBackend(lr=1e-2, micro_batch_size=3, sequence_parallel_size=sp_size,
                           sequence_parallel_mode=mode, packing=packing)
    backend.setup(fabric, model_dir, torch.float32, False, algorithm, embedded=True)
    batch = _batch(algorithm).select(torch.tensor(rows))
    metrics = backend.train(batch, algorithm, max_new_tokens=6)
    weights = {k: v.clone() for k, v in backend.named_weights()}
    if backend.critic is not None:
        weights.update({f"critic.{k}": v.detach().clone() for k, v in backend.critic.module.state_dict().items()})
    torch.save({"metrics": metrics, "weights": weights}, out % fabric.global_rank)


def _two(fabric, model_dir, out, algorithm_name, mode, packing):  # noqa: ANN001, ANN202
    rows = [0, 1, 2, 3] if fabric.global_rank == 0 else [4, 5, 6]  # each rank brings its own rows
    _train(fabric, model_dir, rows, out, algorithm_name, 2, mode, packing)


@pytest.fixture(autouse=True)
def _fresh_port(monkeypatch):  # noqa: ANN001, ANN202
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("algorithm_name,mode,packing", [
    ("grpo", "ring", True),
    ("grpo", "ring", False),
    ("grpo", "ulysses", True),
    ("ppo", "ring", True),  # the critic's value pass and its training are split too
])
def test_sequence_parallel_step_gives_the_same_update_as_one_rank(tmp_path, algorithm_name, mode, packing):
    model_dir = materialize(ModelConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64), char_tokenizer(),
                            0, str(tmp_path / "model"))
    out = str(tmp_path / "result%d.pt")
    _train(Fabric(accelerator="cpu", devices=1), model_dir, list(range(7)), str(tmp_path / "single%d.pt"),
           algorithm_name, 1, "ring", False)
    Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn").launch(_two, model_dir, out, algorithm_name, mode,
                                                                       packing)
    single = torch.load(tmp_path / "single0.pt")
    ranks = [torch.load(out % r) for r in range(2)]
    initial = materialize(ModelConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64), char_tokenizer(),
                          0, str(tmp_path / "again"))
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(initial).state_dict()
    moved = 0
    for name, tensor in single["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name  # identical replicas
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)
        moved += name in before and not torch.allclose(before[name], tensor)
    assert moved > 0  # the step did change the weights: the comparison is not of two untouched models
    keys = ["loss", "entropy", "grad_norm"] + (["critic/value_loss", "critic/grad_norm"] if algorithm_name == "ppo" else [])
    for key in keys:
        assert ranks[0]["metrics"][key] == pytest.approx(single["metrics"][key], rel=METRIC_REL, abs=1e-6), key
    assert ranks[0]["metrics"]["padding_frac"] == pytest.approx(single["metrics"]["padding_frac"], abs=1e-6)
