"""Partial rollouts (``--trainer.partial_rollouts``): a weight update stops the generation in flight between tokens,
and every unfinished response continues from its tokens with the new weights (docs/asynchronous.md)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import (
    FAST,
    assert_partial_rollouts_cut,
    greedy_with_updates,
    injected_updates,
    old_and_new_policies,
    varied_reward,
)

from gcore.algorithms.base import behaviour_weight
from gcore.engines.hf import HFEngine
from gcore.engines.pool import POLICY, RoleSpec, WorkerPool, _WorkerRuntime
from gcore.engines.pool.worker import HOLD_ENV
from gcore.model import ModelSource
from gcore.tracing import read_samples
from gcore.types import SamplingParams


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory):
    """A tiny model's checkpoint, an engine with its weights (old) and one with other weights (new), and those."""
    return old_and_new_policies(str(tmp_path_factory.mktemp("policy")))


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


def _response_logprobs(engine, prompt, tokens):
    """``engine``'s model's log-probabilities of ``tokens`` after ``prompt`` (temperature 1), as the trainer takes
    them."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_cut_samples_old_tokens_keep_the_old_weights_logprobs_and_the_correction_weighs_them(two_policies):
    """A response cut by an update after its 4th token (the worker's runtime, the update's arrival injected): its
    first 4 tokens are version 0 and carry the old weights' log-probabilities (the behaviour policy's), the rest
    version 1 with the new weights'. Trained by the new weights (the proximal policy), the behaviour importance
    ratio the loss weighs each token by (``behaviour_weight``) is 1 on the new tokens, up to float rounding, and
    not 1 on the old ones: the correction acts on exactly the tokens an older version sampled."""
    path, old, new, weights = two_policies
    runtime = _WorkerRuntime({POLICY: RoleSpec(HFEngine(), ModelSource(path))}, release=True,
                             device=torch.device("cpu"))
    runtime.switch(POLICY, None)
    pending, take_sync, updates = injected_updates(runtime, weights, {4})
    prompt, params = [5, 6, 7], SamplingParams(n=1, max_new_tokens=16, temperature=1.0)
    ((g,),) = runtime.generate_partial(POLICY, [prompt], params, 0, None, pending, take_sync)
    assert updates == [1] and len(g.token_ids) > 4, g
    assert g.versions == [0] * 4 + [1] * (len(g.token_ids) - 4)  # two versions, token by token
    behaviour = torch.tensor(g.logprobs)
    assert torch.allclose(behaviour[:4], _response_logprobs(old, prompt, g.token_ids)[:4], atol=1e-5)
    proximal = _response_logprobs(new, prompt, g.token_ids)
    assert torch.allclose(behaviour[4:], proximal[4:], atol=1e-5)
    _, ratio = behaviour_weight(proximal, behaviour, cap=2.0)
    assert (ratio[4:] - 1).abs().max() < 1e-4, ratio
    assert (ratio[:4] - 1).abs().min() > 1e-3, ratio


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


def test_a_checkpoint_records_the_rollouts_in_flight_without_joining_their_generation_with_partial_rollouts():
    """A checkpoint records the rollouts in flight (``InFlightRollouts.in_flight_state``). Without partial rollouts it
    waits for their generation and keeps the engine's outputs (an exact resume); with them it must not wait: the
    rollout would finish with the weights it has, and the next update, the one it was dispatched to be cut by,
    would find nothing in flight. It records the prompts, version and seed (a resumed run generates it again)."""
    from types import SimpleNamespace

    from gcore.inflight import Drawn, InFlightRollouts
    from gcore.placement.base import InFlight
    from gcore.types import Generation

    for partial in (False, True):
        waited = []

        def generations(waited=waited):
            waited.append(1)
            return [[Generation([7, 8], [-0.5, -0.25], True)]]

        rollouts = InFlightRollouts(1, partial=partial)
        job = SimpleNamespace(prompts=[SimpleNamespace(index=3)], policy_version=2, seed=5)
        rollouts.queue = [Drawn(0, [1], [1], 1.0, []),
                          Drawn(1, [3], [3], 1.0, [], rollout=(job, InFlight(list, generations=generations)))]
        (entry,) = rollouts.in_flight_state()
        assert (entry["step"], entry["prompts"], entry["version"], entry["seed"]) == (1, [3], 2, 5)
        assert bool(waited) is not partial and ("tokens" in entry) is not partial, (partial, entry)
        assert entry["deferred"] is False


def test_partial_rollouts_need_max_staleness_and_an_engine_that_stops_between_tokens():
    from gcore import StaticPlacement, Trainer, TrainerConfig
    from gcore.errors import ConfigError

    with pytest.raises(ConfigError, match="needs --trainer.max_staleness >= 1"):
        TrainerConfig(partial_rollouts=True).validate()
    with pytest.raises(ConfigError, match="cannot stop between tokens"):
        Trainer(TrainerConfig(partial_rollouts=True, max_staleness=1), engine=HFEngine(use_generate=True),
                placement=StaticPlacement(workers=1))._validate()


#: the run shapes of the end-to-end test: static placement on one worker with a checkpoint every 2 steps (a
#: checkpoint must not join the generation in flight), on two workers, and dynamic placement
SHAPES = {"static-1-checkpoint": ["--placement.workers", "1", "--trainer.checkpoint_every", "2"],
          "static-2": ["--placement.workers", "2"],
          "dynamic-2": ["--placement", "dynamic", "--placement.workers", "2"]}


@pytest.mark.integration
@pytest.mark.slow  # a CLI run with engine workers
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fit_with_partial_rollouts_cuts_every_step_and_trains_the_old_tokens_with_their_behaviour_logprobs(
        tmp_path, shape):
    """Four steps with K = 1 and partial rollouts through the real pool and workers, in each run shape. The cut is
    made certain by construction, not by timing: with ``GCORE_TEST_PARTIAL_HOLD`` (a test-only hook of the worker)
    a rollout started ahead stops after its 4th token until the weight update comes, so every step after the first
    (which generates its own rollout, with no update to come) trains samples whose tokens span two versions
    (``async/partial_samples`` > 0), their tokens' mean staleness lies strictly between 0 and 1 (the old version's
    first tokens, the new one's rest), no sample is more than one version old, and the loss's behaviour importance
    ratio is not 1 (``async/behaviour_ratio_dev`` far above the float noise of on-policy tokens, 1e-7): the old
    tokens were trained with the old weights' log-probabilities. Every step trains: finite, not skipped, a gradient.
    The reward varies within groups (``varied_reward``) so that no step's groups all tie."""
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", str(tmp_path), *FAST,
           "--trainer.save_final", "false", "--trainer.max_steps", "4", "--trainer.max_staleness", "1",
           "--trainer.partial_rollouts", "true", *SHAPES[shape], "--sampling.max_new_tokens", "48",
           "--sampling.n", "4", "--trainer.trace_samples", "0", *varied_reward(tmp_path)]
    env = {**os.environ, HOLD_ENV: "4"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no weight update came" not in run.stderr, run.stderr[-3000:]
    (metrics,) = tmp_path.glob("gcore/version_*/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("reward/mean")]
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert_partial_rollouts_cut(rows)
    for row in rows:
        assert row["skipped_updates"] == "0.0" and math.isfinite(float(row["grad_norm"])), row
        assert row["samples/trained"] == row["samples/total"] == "16.0", row
        assert float(row["grad_norm"]) > 0, row
    # rollout tracing records each sample's first and last token's versions: the cut ones span two
    traced = read_samples(str(metrics.parent))
    assert len(traced) == 4 * 16
    spans = {step: {(r["version_min"], r["version_max"]) for r in traced if r["step"] == step} for step in range(4)}
    assert spans[0] == {(0, 0)}, spans
    assert all((step - 1, step) in spans[step] for step in (1, 2, 3)), spans
