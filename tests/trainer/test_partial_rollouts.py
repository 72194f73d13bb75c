"""Partial rollouts (``--trainer.partial_rollouts``): a weight update stops the generation in flight between tokens,
and every unfinished response continues from its tokens with the new weights (docs/asynchronous.md)."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest
import torch
from conftest import FAST, greedy_with_updates, injected_updates, varied_reward

from gcore.engines.hf import HFEngine
from gcore.engines.pool import POLICY, RoleSpec, WorkerPool, _WorkerRuntime
from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize
from gcore.types import SamplingParams


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory):
    """A tiny model's checkpoint, an engine with its weights (old) and one with other weights (new), and those."""
    path = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(),
                       seed=0, workdir=str(tmp_path_factory.mktemp("policy")))
    old, new = HFEngine(), HFEngine()
    for engine in (old, new):
        engine.setup(ModelSource(path), torch.device("cpu"))
    assert old.model is not None
    generator = torch.Generator().manual_seed(1)
    weights = [(name, t + 0.5 * torch.randn(t.shape, generator=generator))
               for name, t in old.model.state_dict().items()]
    new.update_weights(weights)
    return path, old, new, weights


@pytest.mark.parametrize("cuts", [[4], [3, 7]])
def test_a_partial_rollout_continues_every_unfinished_response_with_the_new_weights(two_policies, cuts):
    """In the worker's runtime, with the update's arrival injected (``pending`` turns true after the k-th token):
    the tokens before it are the old weights' (with their log-probabilities), those after it the new weights'
    continuation of each response, with one more version per update; nothing is thrown away."""
    path, old, new, weights = two_policies
    runtime = _WorkerRuntime({POLICY: RoleSpec(HFEngine(), ModelSource(path))}, release=True,
                             device=torch.device("cpu"))
    runtime.switch(POLICY, None)
    pending, take_sync, updates = injected_updates(runtime, weights, set(cuts))  # pending: once per token sampled
    prompts, params = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    out = runtime.generate_partial(POLICY, prompts, params, None, None, pending, take_sync)
    expected = greedy_with_updates(old, new, prompts, params, cuts)  # the k-th call comes after the k-th token
    assert len(updates) == len(cuts)
    assert runtime._engine(POLICY).interrupt is None  # put back
    for row, want in zip(out, expected, strict=True):
        assert len(row) == params.n
        for got in row:
            assert got.token_ids == want.token_ids
            assert got.versions == want.versions
            assert got.finished == want.finished
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    assert any(g.versions and max(g.versions) == len(cuts) for row in out for g in row)  # the cut did happen


@pytest.mark.integration
@pytest.mark.slow  # starts an engine worker process
def test_a_weight_sync_reaches_a_worker_during_its_generation_and_the_responses_continue_with_it(two_policies):
    """Through the pool: the sync is sent to the worker while it generates (not queued behind the request), the
    worker answers it mid-request, and the request's responses are the old weights' first tokens followed by the
    new weights' continuation, wherever the update landed."""
    path, old, new, weights = two_policies
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(n=1, max_new_tokens=200, temperature=0.0)
    whole = [g for (g,) in old.generate(prompts, params)]
    assert all(len(g.token_ids) > 100 for g in whole)  # long enough for the update to land inside it
    pool = WorkerPool(1, {POLICY: RoleSpec(HFEngine(), ModelSource(path))}, [POLICY])
    try:
        pool.queue_syncs = pool.partial_rollouts = True
        in_flight = pool.submit_generate(POLICY, prompts, params, [0])
        pool.sync_weights(weights)
        assert not in_flight[0].done
        got = [g for (g,) in pool.collect_generate(in_flight)]
        pool.wait(pool._syncs)
        assert pool._side == {}  # the sync was answered
    finally:
        pool.close()
    cut = got[0].versions.index(1) if got[0].versions else None
    assert cut is not None, "the update did not land during the generation"
    for g in got:
        assert g.versions == [0] * cut + [1] * (len(g.token_ids) - cut)  # every row cut at the same token
    assert [g.token_ids for g in got] == [g.token_ids for g in greedy_with_updates(old, new, prompts, params, [cut])]


def test_partial_rollouts_need_max_staleness_and_an_engine_that_stops_between_tokens():
    from gcore import StaticPlacement, Trainer, TrainerConfig
    from gcore.errors import ConfigError

    with pytest.raises(ConfigError, match="needs --trainer.max_staleness >= 1"):
        TrainerConfig(partial_rollouts=True).validate()
    with pytest.raises(ConfigError, match="cannot stop between tokens"):
        Trainer(TrainerConfig(partial_rollouts=True, max_staleness=1), engine=HFEngine(use_generate=True),
                placement=StaticPlacement(workers=1))._validate()


@pytest.mark.integration
@pytest.mark.slow  # a CLI run with two engine workers
@pytest.mark.parametrize("placement", ["static", "dynamic"])
def test_fit_with_partial_rollouts_trains_within_the_staleness_bound(tmp_path, placement):
    """Three steps with K = 1 and partial rollouts on two engine workers, static or dynamic: each token's version
    is logged through ``async/token_staleness_mean`` (between 0 and 1), no sample is trained more than one version
    old, and every step trains: its update is finite and not skipped, and its gradient is not zero. A step whose groups
    all score the same has no gradient, so the reward varies within groups and each group has 4 samples (with the
    task's reward and 2 samples, all 4 groups tied on some step; with this reward a group of 2 ties about 1 time in 4,
    all four groups about 1 step in 250; with 4 samples, 1 in 125 per group). How many samples an update cuts is a
    matter of timing (``async/partial_samples``)."""
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", str(tmp_path), *FAST,
           "--trainer.save_final", "false", "--trainer.max_steps", "3", "--trainer.max_staleness", "1",
           "--trainer.partial_rollouts", "true", "--placement", placement, "--placement.workers", "2",
           "--sampling.max_new_tokens", "48", "--sampling.n", "4", *varied_reward(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (metrics,) = tmp_path.glob("gcore/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    for row in rows[1:]:
        assert float(row["async/staleness_max"]) <= 1.0
        assert 0.0 <= float(row["async/token_staleness_mean"]) <= 1.0
        assert float(row["async/partial_samples"]) >= 0.0
    trained = [{k: r[k] for k in ("step", "grad_norm", "skipped_updates", "samples/total", "samples/trained",
                                  "trained_rows_frac", "async/partial_samples", "reward/std")} for r in rows]
    for row in trained:
        assert row["skipped_updates"] == "0.0" and math.isfinite(float(row["grad_norm"])), trained
        assert row["samples/trained"] == row["samples/total"] == "16.0", trained
        assert float(row["grad_norm"]) > 0, trained
