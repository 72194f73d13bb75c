"""A training step with sequence parallelism (2 gloo ranks, one group of K=2) gives the same update as
one rank without it, on the same batch.

Tolerance: weights after one AdamW step (lr 1e-2) within atol 2e-5 (0.2% of a step: the split
reorders float32 sums, and Adam's normalisation amplifies that where a gradient is near 0);
loss, entropy and gradient norm within rel 1e-4.
"""

import pytest
import torch
from conftest import padded_batch, spawn
from lightning_fabric import Fabric

from gcore import GRPO, PPO, ModelConfig, TorchBackend
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import set_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]

WEIGHT_ATOL = 2e-5
METRIC_REL = 1e-4


def _batch(algorithm):
    """7 rows of length 7 (odd: not divisible by the 2 ranks), two of them shorter; deterministic."""
    batch = padded_batch()
    if algorithm.needs_critic:  # PPO: values of a fixed (untrained) critic, so advantages are the same everywhere
        batch.values = torch.linspace(-0.5, 0.5, batch.response_mask.numel()).view_as(batch.response_mask)
        batch.values = batch.values * batch.response_mask
    batch.advantages = algorithm.advantages(batch)
    return batch


def _algorithm(name):
    if name == "ppo":  # one epoch, one mini-batch: old logprobs are the current ones (no extra pass)
        return PPO(epochs=1, mini_batches=1, whiten_advantages=False)
    return GRPO(kl_coef=0.0)


def _train(fabric, model_dir, rows, out, algorithm_name, sp_size, mode, packing):
    algorithm = _algorithm(algorithm_name)
    backend = TorchBackend(lr=1e-2, micro_batch_size=3, sequence_parallel_size=sp_size,
                           sequence_parallel_mode=mode, packing=packing)
    backend.setup(fabric, ModelSource(model_dir), algorithm, embedded=True)
    batch = _batch(algorithm).select(torch.tensor(rows))
    metrics = backend.train(batch, set_up(algorithm, 6))
    weights = {k: v.clone() for k, v in backend.named_weights()}
    if backend.critic is not None:
        weights.update({f"critic.{k}": v.detach().clone() for k, v in backend.critic.module.state_dict().items()})
    torch.save({"metrics": metrics, "weights": weights}, out % fabric.global_rank)


def _two(fabric, model_dir, out, algorithm_name, mode, packing):
    rows = [0, 1, 2, 3] if fabric.global_rank == 0 else [4, 5, 6]  # each rank brings its own rows
    _train(fabric, model_dir, rows, out, algorithm_name, 2, mode, packing)



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
    spawn(2, _two, model_dir, out, algorithm_name, mode,
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
    keys = ["loss", "entropy", "grad_norm"] + (
        ["critic/value_loss", "critic/grad_norm"] if algorithm_name == "ppo" else []
    )
    for key in keys:
        assert ranks[0]["metrics"][key] == pytest.approx(single["metrics"][key], rel=METRIC_REL, abs=1e-6), key
    assert ranks[0]["metrics"]["padding_frac"] == pytest.approx(single["metrics"]["padding_frac"], abs=1e-6)


# -- end to end through the CLI ---------------------------------------------------------------

# a deterministic reward that differs between responses, so greedy samples still give advantages
VARIED_REWARD = '''
def score(prompt, response, answer):
    return (sum(map(ord, response)) % 7) / 7.0
'''


def _metrics(root):
    import csv
    import os

    (version,) = [v for v in os.listdir(os.path.join(root, "gcore")) if v.startswith("version_")]
    with open(os.path.join(root, "gcore", version, "metrics.csv")) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _fit(tmp_path, name, *args):
    from conftest import FAST, run_gcore

    result = run_gcore("fit", *FAST, "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path / name),
                       *args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return _metrics(tmp_path / name)


def test_cli_trains_with_sequence_parallel_groups(tmp_path):
    """`gcore fit --trainer.devices 2 --backend.sequence_parallel_size 2`: one group of 2 ranks trains
    on the union of both controllers' samples; every sample is counted once."""
    # every row runs, and a reward that differs within a group even for the untrained model (its
    # target-char groups mostly tie at 0, which gives no gradient): the response's distinct characters
    (tmp_path / "distinct.py").write_text("def score(prompt, response, answer):\n    return len(set(response)) / 8\n")
    rows = _fit(tmp_path, "sp", "--trainer.devices", "2", "--backend.sequence_parallel_size", "2",
                "--sampling.max_new_tokens", "7", "--backend.skip_inert_rows", "false",
                "--reward", "python", "--reward.function", str(tmp_path / "distinct.py") + ":score")
    assert [r["step"] for r in rows] == [0.0, 1.0]
    for r in rows:
        assert r["samples/total"] == 8.0 and r["samples/trained"] == 8.0  # 4 prompts x n=2, not doubled
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["skipped_updates"] == 0.0
        for key in ("loss", "entropy", "grad_norm"):
            assert torch.isfinite(torch.tensor(r[key])), key
        assert 0.0 < r["entropy"] < 5.0  # nats: an untrained model over the ~90-character vocabulary
    assert rows[0]["grad_norm"] > 0.0


def test_cli_first_step_with_sequence_parallel_equals_one_rank(tmp_path):
    """The same prompts and (greedy: top_k 1) samples on 1 rank and on a 2-rank SP group give the same
    first-step loss, value loss and gradient norms (PPO: policy, critic and reference passes all split)."""
    (tmp_path / "reward.py").write_text(VARIED_REWARD)
    common = ("--sampling.top_k", "1", "--sampling.max_new_tokens", "7", "--algorithm", "ppo",
              "--algorithm.epochs", "1", "--algorithm.mini_batches", "1", "--algorithm.whiten_advantages", "false",
              "--algorithm.kl_coef", "0.1", "--reward", "python", "--reward.function", f"{tmp_path}/reward.py:score",
              "--trainer.max_steps", "1")
    one = _fit(tmp_path, "one", *common)[0]
    sp = _fit(tmp_path, "sp", "--trainer.devices", "2", "--backend.sequence_parallel_size", "2", *common)[0]
    assert one["loss"] != 0.0 and one["critic/value_loss"] > 0.0  # the comparison is not of zeros
    for key in ("reward/mean", "samples/total", "response_length/mean"):
        assert sp[key] == one[key], key
    for key in ("loss", "entropy", "grad_norm", "critic/value_loss", "critic/grad_norm"):
        assert sp[key] == pytest.approx(one[key], rel=METRIC_REL, abs=1e-6), key
