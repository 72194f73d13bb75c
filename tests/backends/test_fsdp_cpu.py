"""``--backend.strategy fsdp`` on CPU: FSDP2 (``fully_shard``) under Fabric's ModelParallelStrategy, 2 gloo ranks.

One training step under FSDP gives the same loss, gradient norm and updated full weights as DDP on the
same per-rank batches (each rank brings its own rows, unevenly: 4 and 3 rows in micro-batches of 3, so
the ranks run different numbers of micro-batches and the padding passes are exercised); the policy's
and the reference's log-probabilities and the critic's values agree too; the engine receives the full
weights; ``save_pretrained`` writes them; shared-prompt forwards (two model calls per micro-batch)
agree with DDP too; a DCP checkpoint of the sharded state loads back.

Tolerance (float32): weights within atol 2e-5 after one AdamW step at lr 1e-2 (as in
test_sequence_parallel_training: Adam's normalisation amplifies float rounding where a gradient is near
0); loss, entropy, gradient norms within rel 1e-5 + atol 1e-7 (the first GRPO loss cancels to ~1e-8);
log-probabilities and values within atol 1e-5.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port
from lightning_fabric import Fabric

from gcore import GRPO, PPO, ModelConfig, TorchBackend
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import make_batch, set_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]

WEIGHT_ATOL = 2e-5
METRIC_REL = 1e-5
METRIC_ATOL = 1e-7  # GRPO's first-step loss is a sum of terms that cancel to ~1e-8
VALUE_ATOL = 1e-5


def _algorithm(name):
    if name == "ppo":  # one epoch, one mini-batch: the critic trains in the same loop
        return PPO(epochs=1, mini_batches=1, whiten_advantages=False)
    if name in ("grpo_kl", "grpo_shared"):  # a reference model and its KL term
        return GRPO(kl_coef=0.1)
    return GRPO(kl_coef=0.0)


def _batch(algorithm, rank, shared=False):
    batch = make_batch([1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.3], [0, 0, 1, 1, 2, 2, 2], length=9)
    batch.input_ids = torch.randint(4, 60, batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
    if shared:  # a 3-token prompt per group, which the shared-prompt forward runs once
        batch.prompt_lengths = torch.full((len(batch),), 3)
        batch.response_mask[:, :2] = 0
        for row, group in enumerate(batch.group_ids.tolist()):
            batch.input_ids[row, :3] = batch.input_ids[batch.group_ids.tolist().index(group), :3]
    batch.attention_mask[1, 7:] = 0
    batch.response_mask[1, 6:] = 0
    if algorithm.needs_critic:  # values of a fixed critic, so the advantages are the same under both strategies
        batch.values = torch.linspace(-0.5, 0.5, batch.response_mask.numel()).view_as(batch.response_mask)
        batch.values = batch.values * batch.response_mask
    batch.advantages = algorithm.advantages(batch)
    return batch.select(torch.tensor([0, 1, 2, 3] if rank == 0 else [4, 5, 6]))


def _run(strategy, model_dir, algorithm_name, out_dir, rank):
    from gcore.engines.hf import HFEngine

    algorithm, shared = _algorithm(algorithm_name), algorithm_name == "grpo_shared"
    # grpo_shared: rank 0's first micro-batch shares prompts, its second (one row) cannot; rank 1's one
    # micro-batch shares, its padding pass cannot: the ranks must agree per pass under FSDP
    backend = TorchBackend(lr=1e-2, micro_batch_size=3, strategy=strategy, share_prompts=shared)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=backend.strategy(2, "cpu"))
    fabric.launch()
    backend.setup(fabric, ModelSource(model_dir), algorithm, embedded=True)
    batch = _batch(algorithm, rank, shared)
    result = {"logprobs": backend.compute_logprobs(batch, "policy")}
    if algorithm.needs_reference:
        result["ref_logprobs"] = backend.compute_logprobs(batch, "reference")
        batch.ref_logprobs = result["ref_logprobs"]
    batch.old_logprobs = result["logprobs"]
    if algorithm.needs_critic:
        result["values"] = backend.compute_values(batch)
    result["metrics"] = backend.train(batch, set_up(algorithm, 8))
    engine = HFEngine()
    engine.setup(ModelSource(model_dir), torch.device("cpu"))
    engine.update_weights(backend.named_weights())  # what the controller does after each update
    result["weights"] = {k: v.detach().clone() for k, v in backend.named_weights()}
    result["engine"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
    if backend.critic is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        critic = get_model_state_dict(backend.critic.module, options=StateDictOptions(full_state_dict=True))
        result["weights"].update({f"critic.{k}": v.clone() for k, v in critic.items()})
    if strategy == "fsdp":
        result["sharded"] = [type(p).__name__ for p in backend.policy.parameters()]
        if rank == 0:
            backend.save_pretrained(os.path.join(out_dir, "saved"))
        if not shared:
            _checkpoint_round_trip(backend, fabric, model_dir, algorithm, os.path.join(out_dir, "ckpt"), result)
    fabric.barrier()
    return result


def _checkpoint_round_trip(backend, fabric, model_dir, algorithm, path, result):
    """Save the sharded state with DCP, load it into a fresh FSDP backend, and take one more step with
    both: the same weights before and after that step (so the optimizer state came back too)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(backend.state_dict(), checkpoint_id=path)
    fresh = TorchBackend(lr=1e-2, micro_batch_size=3, strategy="fsdp", share_prompts=False)
    fresh.setup(fabric, ModelSource(model_dir), algorithm, embedded=True)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    result["loaded"] = {k: v.clone() for k, v in fresh.named_weights()}
    batch = _batch(algorithm, fabric.global_rank)
    batch.old_logprobs = backend.compute_logprobs(batch, "policy")
    if algorithm.needs_reference:
        batch.ref_logprobs = backend.compute_logprobs(batch, "reference")
    backend.train(batch, set_up(algorithm, 8))
    fresh.train(batch, set_up(algorithm, 8))
    result["second_step"] = {k: v.clone() for k, v in backend.named_weights()}
    result["second_step_resumed"] = {k: v.clone() for k, v in fresh.named_weights()}


def _worker(rank, port, model_dir, algorithm_name, out_dir):
    # the ranks are started here, not by Lightning: LOCAL_RANK tells Fabric the processes exist already
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    import gcore.backends.torch.forward as torch_backend  # the module that calls it

    shared_forward = torch_backend.shared_prompt_logits
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return shared_forward(*args, **kwargs)

    torch_backend.shared_prompt_logits = counted
    results = {}
    for strategy in ("ddp", "fsdp"):
        calls.clear()
        results[strategy] = _run(strategy, model_dir, algorithm_name, out_dir, rank)
        results[strategy]["shared_calls"] = len(calls)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))



@pytest.fixture(autouse=True)
def _fresh_env(monkeypatch):
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)


def _close(a, b, rel=METRIC_REL):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + METRIC_ATOL


@pytest.mark.parametrize("algorithm_name", ["grpo", "grpo_kl", "ppo", "grpo_shared"])
def test_fsdp_step_matches_ddp_on_two_cpu_ranks(tmp_path, algorithm_name):
    model_dir = materialize(ModelConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64), char_tokenizer(),
                            0, str(tmp_path / "model"))
    mp.start_processes(_worker, args=(free_port(), model_dir, algorithm_name, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, results in enumerate(ranks):
        ddp, fsdp = results["ddp"], results["fsdp"]
        # grpo_shared: the shared-prompt forward really ran, under FSDP too (where a pass shares only when
        # every rank's micro-batch qualifies, so possibly less often than under DDP)
        for calls in (ddp["shared_calls"], fsdp["shared_calls"]):
            assert (calls > 0) == (algorithm_name == "grpo_shared"), (ddp["shared_calls"], fsdp["shared_calls"])
        assert set(fsdp["sharded"]) == {"DTensor"}  # really sharded, not a replicated fallback
        for key in ("logprobs", "ref_logprobs", "values"):
            if key in ddp:
                assert (fsdp[key] - ddp[key]).abs().max() <= VALUE_ATOL, (rank, key)
        for key in ("loss", "entropy", "grad_norm", "critic/grad_norm", "critic/value_loss"):
            if key in ddp["metrics"]:
                assert _close(fsdp["metrics"][key], ddp["metrics"][key]), (rank, key, fsdp["metrics"][key],
                                                                            ddp["metrics"][key])
        assert ddp["metrics"]["grad_norm"] > 0
        assert sorted(fsdp["weights"]) == sorted(ddp["weights"])
        for name, tensor in ddp["weights"].items():
            assert fsdp["weights"][name].shape == tensor.shape, name  # full, not a shard
            assert (fsdp["weights"][name] - tensor).abs().max() <= WEIGHT_ATOL, (rank, name)
        for name, tensor in fsdp["engine"].items():  # the engine holds exactly the trainer's full weights
            assert torch.equal(tensor, fsdp["weights"][name]), (rank, name)
        for name, tensor in fsdp.get("loaded", {}).items():  # the checkpoint brings the sharded state back exactly
            assert torch.equal(tensor, fsdp["weights"][name]), (rank, name)
        for name, tensor in fsdp.get("second_step", {}).items():  # ... optimizer state included
            assert torch.equal(tensor, fsdp["second_step_resumed"][name]), (rank, name)
    for name, tensor in ranks[0]["fsdp"]["weights"].items():  # every rank gathers the same full weights
        assert torch.equal(tensor, ranks[1]["fsdp"]["weights"][name]), name
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved")).state_dict()
    for name, tensor in saved.items():
        assert torch.equal(tensor, ranks[0]["fsdp"]["weights"][name]), name


def test_cli_fit_under_fsdp_on_two_cpu_ranks_saves_and_resumes(gcore_cli, tmp_path):
    args = ("--backend.strategy", "fsdp", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--algorithm", "ppo", "--trainer.checkpoint_every", "1")
    first = gcore_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    final = next((tmp_path / "runs").rglob("final"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(final))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    resumed = gcore_cli(*args, "--trainer.max_steps", "3", "--trainer.resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout, resumed.stdout[-2000:]
