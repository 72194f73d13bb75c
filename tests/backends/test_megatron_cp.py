"""The megatron backend's context parallelism (``--backend.sequence_parallel_size K``): megatron-core's
CP with gcore's ring/Ulysses attention as the layers' ``core_attention`` (gcore/backends/megatron/context_parallel.py).

With 2 gloo processes on CPU (CP=2, TP=1), on the same 7-row batch (rows of length 7, not a
multiple of 2*CP, two of them padded shorter; each rank brings its own rows): per-token
log-probabilities equal the one-process megatron backend's (CP=1) and the torch backend's within
1e-5, and one train step gives the same loss, entropy and gradient norm (rel 1e-4) and the same
weights: atol 2e-5 against the torch backend (as tests/backends/test_sequence_parallel_training.py: 0.2 % of
an lr-1e-2 AdamW step), 3e-5 against megatron at CP=1, whose local attention (baddbmm, then softmax)
rounds differently from the SDPA / online-softmax kernels gcore's attention and torch use.
Measured (2026-11-23, this 2-core CPU): log-probabilities <= 4.8e-7 off; weights 7.2e-6 off the torch
backend's and 1.6e-5 off megatron CP=1's; loss rel 5e-8; grad norm rel 1e-7.
"""

import os

import pytest
import torch
from conftest import padded_batch, spawn
from lightning_fabric import Fabric

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.errors import ConfigError
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import set_up

LOGPROB_TOL = 1e-5
WEIGHT_ATOL = {"torch": 2e-5, "megatron": 3e-5}
METRIC_REL = 1e-4


def _megatron():
    pytest.importorskip("megatron.core")
    from gcore.backends.megatron import MegatronBackend

    return MegatronBackend



# configurations that cannot work: one line naming the flag ----------------------------------------


def test_context_parallel_with_pipeline_stages_is_refused():
    backend_class = _megatron()
    with pytest.raises(ConfigError, match="sequence_parallel_size 2 with --backend.pipeline_parallel_size 2"):
        backend_class(sequence_parallel_size=2, pipeline_parallel_size=2)


def test_context_parallel_with_transformer_engine_is_refused():
    backend_class = _megatron()
    with pytest.raises(ConfigError, match="transformer_engine true.*auto or false"):
        backend_class(sequence_parallel_size=2, transformer_engine="true")


def test_bad_sequence_parallel_mode_and_size_are_one_line():
    backend_class = _megatron()
    with pytest.raises(ConfigError, match="sequence_parallel_mode 'zigzag': valid choices are ring, ulysses"):
        backend_class(sequence_parallel_size=2, sequence_parallel_mode="zigzag")
    with pytest.raises(ConfigError, match="sequence_parallel_size must be >= 1, got 0"):
        backend_class(sequence_parallel_size=0)


def test_sizes_that_do_not_divide_the_ranks_are_refused(tmp_path):
    backend_class = _megatron()
    model_dir = _model_dir(tmp_path)
    backend = backend_class(sequence_parallel_size=2)
    with pytest.raises(ConfigError, match="sequence_parallel_size 2 times --backend.tensor_parallel_size 1 does not "
                                          r"divide the number of ranks \(1\)"):
        backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(model_dir), GRPO(kl_coef=0.0),
                      embedded=True)


# the split is megatron's ------------------------------------------------------------------------


def test_rotary_slice_is_megatrons_zigzag_chunks():
    """``rotary_on_this_cp_rank`` (the CPU stand-in for ``get_pos_emb_on_this_cp_rank``) keeps chunks r and
    2K-1-r of 2K, and the token split (``zigzag_indices``) is the same."""
    _megatron()
    from gcore.backends.megatron.context_parallel import rotary_on_this_cp_rank
    from gcore.backends.sequence_parallel import zigzag_indices

    table = torch.arange(12.0)[:, None, None, None]
    assert rotary_on_this_cp_rank(table, 2, 0).flatten().tolist() == [0, 1, 2, 9, 10, 11]
    assert rotary_on_this_cp_rank(table, 2, 1).flatten().tolist() == [3, 4, 5, 6, 7, 8]
    assert rotary_on_this_cp_rank(table, 3, 2).flatten().tolist() == [4, 5, 6, 7]
    assert zigzag_indices(12, 2).tolist() == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]


# 2 processes: CP=2 vs one process -------------------------------------------------------------------


def _model_dir(root):
    return materialize(ModelConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64), char_tokenizer(), 0,
                       os.path.join(str(root), "model"))


def _batch():
    """7 rows of length 7 (not a multiple of 2*CP = 4), rows 1 and 4 padded shorter; deterministic."""
    batch = padded_batch()
    # fixed advantages that do not sum to zero, so the first step's loss is not ~0
    batch.advantages = torch.tensor([1.0, -0.5, 0.8, 0.3, -0.2, 0.6, 0.4])
    return batch


def _step(backend, fabric, model_dir, rows):
    backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    batch = _batch().select(torch.tensor(rows))
    logprobs = backend.compute_logprobs(batch, "policy")
    metrics = backend.train(batch, set_up(GRPO(kl_coef=0.0), 6))
    weights = {k: v.clone() for k, v in backend.named_weights()}
    return {"logprobs": logprobs, "metrics": metrics, "weights": weights}


ROWS = {2: [[0, 1, 2, 3], [4, 5, 6]], 4: [[0, 1], [2, 3], [4, 5], [6]]}  # each rank brings its own rows


def _context_parallel(fabric, model_dir, out, mode, distributed, tp):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from gcore.backends.megatron import MegatronBackend
    from gcore.backends.sequence_parallel import zigzag_indices

    rows = ROWS[fabric.world_size][fabric.global_rank]
    backend = MegatronBackend(tensor_parallel_size=tp, sequence_parallel_size=2, sequence_parallel_mode=mode, lr=1e-2,
                              micro_batch_size=3, distributed_optimizer=distributed)
    result = _step(backend, fabric, model_dir, rows)
    # megatron's own split of a batch over the CP group (get_batch_on_this_cp_rank) is gcore's zig-zag split
    split = get_batch_on_this_cp_rank({"tokens": torch.arange(12).view(1, 12)},
                                      parallel_state.get_context_parallel_group())["tokens"][0]
    result["megatron_split"] = torch.equal(split, zigzag_indices(12, 2)[parallel_state.get_context_parallel_rank()])
    result["cp_size"] = parallel_state.get_context_parallel_world_size()
    result["optimizer"] = type(backend.optimizer.optimizer).__name__
    torch.save(result, f"{out}.{fabric.global_rank}")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process, all 7 rows: the megatron backend at CP=1 and the torch backend."""
    backend_class = _megatron()
    root = tmp_path_factory.mktemp("reference")
    model_dir = _model_dir(root)
    fabric = Fabric(accelerator="cpu", devices=1)
    megatron = _step(backend_class(lr=1e-2, micro_batch_size=3), fabric, model_dir, list(range(7)))
    torch_backend = _step(TorchBackend(lr=1e-2, micro_batch_size=3), fabric, model_dir, list(range(7)))
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    return {"megatron": megatron, "torch": torch_backend, "initial": initial, "model_dir": model_dir}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "distributed", "tp"),
                         [("ring", False, 1), ("ulysses", False, 1), ("ring", True, 1), ("ring", False, 2)])
def test_context_parallel_step_matches_one_process(tmp_path, references, mode, distributed, tp):
    """CP=2 on 2 ranks (torch AdamW with gradients all-reduced over DP x CP, or megatron's distributed
    optimizer, whose grad buffers reduce over DP x CP), and TP=2 x CP=2 on 4 ranks (vocabulary-parallel
    log-probabilities of the split rows), give the logprobs, loss and update of one process."""
    out = str(tmp_path / "result")
    world = 2 * tp
    spawn(world, _context_parallel, references["model_dir"], out, mode, distributed, tp)
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    for r, result in enumerate(ranks):
        assert result["cp_size"] == 2 and result["megatron_split"]
        assert result["optimizer"] == ("ChainedOptimizer" if distributed else "AdamW")
        start = sum(len(rows) for rows in ROWS[world][:r])
        own = slice(start, start + len(ROWS[world][r]))
        for name in ("megatron", "torch"):
            reference = references[name]
            assert (result["logprobs"] - reference["logprobs"][own]).abs().max() < LOGPROB_TOL, name
            for key in ("loss", "entropy", "grad_norm"):
                assert result["metrics"][key] == pytest.approx(reference["metrics"][key], rel=METRIC_REL, abs=1e-6), \
                    (name, key)
            moved = 0
            for key, tensor in reference["weights"].items():
                torch.testing.assert_close(result["weights"][key], tensor, rtol=0, atol=WEIGHT_ATOL[name], msg=key)
                moved += not torch.allclose(references["initial"][key], tensor)
            assert moved > 0  # the step changed the weights: not a comparison of two untouched models
    assert ranks[0]["logprobs"].abs().sum() > 0  # padded rows give zeros past their length, others do not
    assert (ranks[0]["logprobs"][1, 4:] == 0).all()
    for result in ranks[1:]:  # the CP (and TP) ranks hold one model
        for key, tensor in ranks[0]["weights"].items():
            assert torch.equal(result["weights"][key], tensor), key


@pytest.mark.integration
@pytest.mark.slow
def test_cli_fit_with_megatron_context_parallel(gcore_cli, tmp_path):
    """`gcore fit --backend megatron --backend.sequence_parallel_size 2` on 2 ranks trains and saves."""
    _megatron()
    import csv

    from transformers import AutoModelForCausalLM

    # a reward that differs within a group even for the untrained model (its target-char groups mostly
    # tie at 0 and would give no gradient): the number of distinct characters in the response
    (tmp_path / "distinct.py").write_text("def score(prompt, response, answer):\n    return len(set(response)) / 8\n")
    run = gcore_cli("--backend", "megatron", "--backend.sequence_parallel_size", "2", "--trainer.devices", "2",
                    "--trainer.accelerator", "cpu", "--sampling.max_new_tokens", "7",
                    "--reward", "python", "--reward.function", str(tmp_path / "distinct.py") + ":score", timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    with open(metrics) as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    assert [r["step"] for r in rows] == [0.0, 1.0]
    for r in rows:
        assert r["samples/total"] == 8.0 and r["skipped_updates"] == 0.0
        for key in ("loss", "entropy", "grad_norm"):
            assert torch.isfinite(torch.tensor(r[key])), key
        assert 0.0 < r["entropy"] < 5.0
    assert rows[0]["grad_norm"] > 0.0
    AutoModelForCausalLM.from_pretrained(next((tmp_path / "runs").rglob("final")))
