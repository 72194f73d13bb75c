"""``--backend.strategy fsdp`` with image prompts, on CPU (2 gloo ranks): one PPO step on the embedded tiny
Qwen2-VL-shaped model gives what DDP gives on the same per-rank image batches: the policy's log-probabilities,
the critic's values, the loss, the gradient norms, and the updated policy and critic weights (vision encoder
included); the engine receives the full weights. Rank 0 brings 6 rows and rank 1 3, in micro-batches of 4, so
rank 1 runs an image padding pass. Tolerances as in test_fsdp_cpu.py.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, image_prompts
from lightning_fabric import Fabric

from gcore import PPO, HFEngine, ModelConfig, SamplingParams, TorchBackend
from gcore.model import load_tokenizer, materialize
from gcore.testing import set_up
from gcore.types import collate
from gcore.vision import load_processor

pytestmark = [pytest.mark.slow, pytest.mark.integration]

WEIGHT_ATOL = 2e-5
METRIC_REL = 1e-5
METRIC_ATOL = 1e-7
VALUE_ATOL = 1e-5
CONFIG = ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128)


def _batch(path, rank):
    """Three samples of each of the four image prompts, made by the engine; rank 0 takes rows 0-5, rank 1 6-8."""
    from conftest import image_samples

    tokenizer = load_tokenizer(CONFIG, vision=True)
    engine = HFEngine()
    engine.setup(CONFIG.source(path), torch.device("cpu"))
    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    torch.manual_seed(0)
    samples = image_samples(engine, tokenizer, image_prompts(load_processor(path, trust_remote_code=False)), params)
    for i, sample in enumerate(samples):
        sample.reward = (i * 7 % 5) / 4
    batch = collate(samples, tokenizer.pad_token_id, params.temperature)
    return batch.select(torch.arange(6) if rank == 0 else torch.arange(6, 9))


def _run(strategy, path, rank):
    algorithm = PPO(epochs=1, mini_batches=1, whiten_advantages=False)
    backend = TorchBackend(lr=1e-2, micro_batch_size=4, strategy=strategy)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=backend.strategy(2, "cpu"))
    fabric.launch()
    backend.setup(fabric, CONFIG.source(path), algorithm, embedded=True)
    assert backend.critic is not None
    with torch.no_grad():  # a critic head that is not zero, so that the values and their gradients show the trunk
        from torch.distributed.tensor import DTensor, distribute_tensor

        weight = backend.critic.module.head.weight
        full = torch.linspace(-0.05, 0.05, weight.numel()).view(weight.shape)
        weight.copy_(distribute_tensor(full, weight.device_mesh, weight.placements)
                     if isinstance(weight, DTensor) else full)
    batch = _batch(path, rank)
    result = {"logprobs": backend.compute_logprobs(batch, "policy"), "values": backend.compute_values(batch)}
    batch.old_logprobs, batch.values = result["logprobs"], result["values"]
    batch.advantages = algorithm.advantages(batch)
    result["metrics"] = backend.train(batch, set_up(algorithm, 8))
    engine = HFEngine()
    engine.setup(CONFIG.source(path), torch.device("cpu"))
    engine.update_weights(backend.named_weights())
    result["weights"] = {k: v.detach().clone() for k, v in backend.named_weights()}
    result["engine"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    critic = get_model_state_dict(backend.critic.module, options=StateDictOptions(full_state_dict=True))
    result["weights"].update({f"critic.{k}": v.clone() for k, v in critic.items()})
    if strategy == "fsdp":
        result["sharded"] = {type(p).__name__ for p in backend.policy.parameters()}
    fabric.barrier()
    return result


def _worker(rank, port, path, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    results = {strategy: _run(strategy, path, rank) for strategy in ("ddp", "fsdp")}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))



def _close(a, b):
    return abs(a - b) <= METRIC_REL * max(abs(a), abs(b)) + METRIC_ATOL


def test_fsdp_ppo_step_on_image_prompts_matches_ddp(tmp_path):
    path = materialize(CONFIG, load_tokenizer(CONFIG, vision=True), 0, str(tmp_path / "model"), vision=True)
    mp.start_processes(_worker, args=(free_port(), path, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, results in enumerate(ranks):
        ddp, fsdp = results["ddp"], results["fsdp"]
        assert fsdp["sharded"] == {"DTensor"}
        for key in ("logprobs", "values"):
            assert (fsdp[key] - ddp[key]).abs().max() <= VALUE_ATOL, (rank, key)
        for key in ("loss", "entropy", "grad_norm", "critic/grad_norm", "critic/value_loss"):
            assert _close(fsdp["metrics"][key], ddp["metrics"][key]), (rank, key, fsdp["metrics"][key],
                                                                        ddp["metrics"][key])
        assert ddp["metrics"]["grad_norm"] > 0 and ddp["metrics"]["critic/grad_norm"] > 0
        assert sorted(fsdp["weights"]) == sorted(ddp["weights"])
        assert any(".visual." in name or name.startswith("visual.") for name in ddp["weights"])
        for name, tensor in ddp["weights"].items():
            assert (fsdp["weights"][name] - tensor).abs().max() <= WEIGHT_ATOL, (rank, name)
        for name, tensor in fsdp["engine"].items():
            assert torch.equal(tensor, fsdp["weights"][name]), (rank, name)
