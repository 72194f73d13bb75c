"""Partial rollouts with multi-turn episodes and with a generative judge (docs/asynchronous.md): such a rollout runs in
a thread of the controller, the pool takes that thread's requests and the controller's weight sync at once, and the
sync cuts the turn in flight instead of waiting for the rollout."""

from __future__ import annotations

import threading

import pytest
from conftest import Scripted, greedy_with_updates, old_and_new_policies, varied_reward

from gcore import CallableReward, DynamicPlacement, StaticPlacement, Trainer, TrainerConfig
from gcore.data import DataConfig
from gcore.engines.base import JUDGE
from gcore.engines.hf import HFEngine
from gcore.engines.pool import POLICY, RoleSpec, WorkerPool
from gcore.engines.pool.worker import HOLD_ENV
from gcore.envs.episodes import run_episodes
from gcore.envs.reveal import RevealEnvironment
from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize
from gcore.rewards.generative import GenerativeReward
from gcore.types import Generation, Prompt, SamplingParams

TINY = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory):
    """A tiny model's checkpoint, an engine with its weights (old) and one with other weights (new), and those."""
    return old_and_new_policies(str(tmp_path_factory.mktemp("policy")))


def test_an_episodes_tokens_carry_their_turns_versions_and_its_observations_the_turn_before_theirs():
    """The episode loop keeps each turn's token versions (``Generation.versions``, counted from the rollout's start)
    across turns: a turn cut by an update (versions 0 then 1), the next turn all 1 (as the pool returns a turn sent
    after the update: ``WorkerPool._rebase``), the observation between them the version of the turn before it
    (context, mask 0); ``Sample.token_versions`` adds the rollout's policy version. An episode no update reached
    keeps ``None``, as a single-turn sample does."""
    tokenizer = char_tokenizer()

    def scripted(*versions):
        calls = iter(versions)

        def generate(prompts, params):
            v = next(calls)
            return [[Generation([40, 41, 42, 43], [-0.5] * 4, True, v)] for _ in prompts]

        return generate

    prompts = [Prompt(0, "0=", tokenizer("0=")["input_ids"], "0")]
    params = SamplingParams(n=1, max_new_tokens=4)
    (sample,) = run_episodes(Scripted(turns=2), scripted([0, 0, 1, 1], [1, 1, 1, 1]), prompts, params, tokenizer,
                             policy_version=5)
    assert sample.turns == 2 and sample.token_versions is not None
    mask, versions = sample.response_mask, sample.token_versions
    assert len(versions) == len(sample.response_ids) == len(mask)
    observation = [v for v, m in zip(versions, mask, strict=True) if m == 0]
    assert observation and set(observation) == {6}  # after the cut turn's last token (version 1)
    assert [v for v, m in zip(versions, mask, strict=True) if m == 1] == [5, 5, 6, 6, 6, 6, 6, 6]
    (plain,) = run_episodes(Scripted(turns=2), scripted(None, None), prompts, params, tokenizer, policy_version=5)
    assert plain.token_versions is None


@pytest.mark.integration
@pytest.mark.slow  # starts an engine worker process
def test_the_pool_takes_a_generate_from_one_thread_and_a_weight_sync_from_another(two_policies, monkeypatch):
    """A rollout's thread sends an episode's turn and waits for it; the controller's thread sends a weight sync
    meanwhile (the pool's lock: each takes the dispatcher in turn, and whoever pumps records every reply). The sync
    reaches the worker during the turn (held at its 4th token by the test hook until the sync comes): the turn's first
    4 tokens are the old weights', the rest the new weights' continuation; the next turn, sent after the sync, is the
    new weights' with every token one version newer than the rollout's start (``base``); both threads finish."""
    path, old, new, weights = two_policies
    monkeypatch.setenv(HOLD_ENV, "4")
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(n=1, max_new_tokens=24, temperature=0.0)
    pool = WorkerPool(1, {POLICY: RoleSpec(HFEngine(), ModelSource(path))}, [POLICY])
    results: dict[str, object] = {}
    synced = threading.Event()

    def rollout() -> None:
        try:
            results["first"] = pool.generate(POLICY, prompts, params, [0], base=0, hold=True)
            synced.wait(120)
            results["second"] = pool.generate(POLICY, prompts, params, [0], base=0, hold=False)
        except BaseException as err:  # noqa: BLE001  reported by the main thread's assertions
            results["error"] = err

    try:
        pool.queue_syncs = pool.partial_rollouts = True
        thread = threading.Thread(target=rollout)
        thread.start()
        for _ in range(6000):  # the turn is with the worker (the hold keeps it there until the sync)
            if pool._busy_with[0] is not None or "error" in results:
                break
            threading.Event().wait(0.01)
        pool.sync_weights(weights)  # from this thread, while the other waits on its turn
        synced.set()
        thread.join(300)
        assert not thread.is_alive() and "error" not in results, results
        pool.wait(pool._syncs)
        assert pool._side == {} and pool.version == 1
    finally:
        synced.set()
        pool.close()
    first = [g for (g,) in results["first"]]  # type: ignore[attr-defined]
    assert all(g.versions == [0] * 4 + [1] * (len(g.token_ids) - 4) for g in first), [g.versions for g in first]
    assert [g.token_ids for g in first] == [g.token_ids for g in greedy_with_updates(old, new, prompts, params, [4])]
    second = [g for (g,) in results["second"]]  # type: ignore[attr-defined]
    assert all(g.versions == [1] * len(g.token_ids) for g in second), [g.versions for g in second]
    assert [g.token_ids for g in second] == [g.token_ids for (g,) in new.generate(prompts, params)]


@pytest.mark.integration
@pytest.mark.slow  # starts an engine worker process
def test_a_sync_during_the_judges_turn_reaches_no_judge_worker_and_the_swap_back_loads_it(two_policies):
    """A worker swapped to the judge gets no weight sync (only policy workers do); swapped back to the policy it
    loads the latest weights, which its next generation samples with."""
    path, old, new, weights = two_policies
    spec = RoleSpec(HFEngine(), ModelSource(path))
    prompts, params = [[5, 6, 7]], SamplingParams(n=1, max_new_tokens=12, temperature=0.0)
    pool = WorkerPool(1, {POLICY: spec, JUDGE: spec}, [POLICY])
    try:
        pool.queue_syncs = pool.partial_rollouts = True
        pool.assign([JUDGE])
        stats = pool.sync_weights(weights)
        assert stats["bytes"] == 0.0 and pool._syncs == []  # nothing went to the judge
        pool.assign([POLICY])
        (got,), = pool.generate(POLICY, prompts, params, [0])
    finally:
        pool.close()
    ((want,),) = new.generate(prompts, params)
    assert got.token_ids == want.token_ids


def _fit(tmp_path, placement, reward=None, env=None, steps=3):
    return Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              save_final=False, max_staleness=1, partial_rollouts=True),
        model=ModelConfig(**TINY),
        data=DataConfig(task="reveal" if env is not None else "arithmetic", prompts_per_step=2),
        sampling=SamplingParams(n=4, max_new_tokens=12),
        placement=placement, **({"env": env} if env is not None else {}), **({"reward": reward} if reward else {}),
    ).fit()


def _assert_cut(history):
    """Every step after the first (which generates its own rollout, with no update to come) trained samples whose
    tokens span two versions, none more than one version old, with the behaviour correction at work."""
    seen = [{k: m.get(k) for k in ("async/partial_samples", "async/token_staleness_mean", "async/behaviour_ratio_dev",
                                   "async/staleness_max")} for m in history]
    assert history[0]["async/partial_samples"] == 0.0, seen
    for metrics in history[1:]:
        assert metrics["async/partial_samples"] > 0, seen
        assert 0.0 < metrics["async/token_staleness_mean"] < 1.0, seen
        assert metrics["async/staleness_max"] <= 1.0, seen
        assert metrics["async/behaviour_ratio_dev"] > 1e-4, seen


@pytest.mark.integration
@pytest.mark.slow  # engine worker processes
@pytest.mark.parametrize("placement", [lambda: StaticPlacement(workers=1), lambda: DynamicPlacement(workers=2)],
                         ids=["static-1", "dynamic-2"])
def test_partial_rollouts_cut_a_turn_of_a_multi_turn_episode(tmp_path, monkeypatch, placement):
    """K = 1, two-turn episodes of the embedded reveal task on engine workers: the rollout started ahead runs in a
    thread while the step trains, and the weight sync cuts its first turn in flight (held at its 4th token by the test
    hook until the sync comes: certain whatever the machine's speed) instead of waiting for the rollout; the turn goes
    on with the new weights, the next turn is of the new version, and the samples span both; the correction weighs
    their old tokens."""
    monkeypatch.setenv(HOLD_ENV, "4")
    varied_reward(tmp_path)  # a reward that differs within groups (added to the episodes'), so that no step all ties
    reward = CallableReward(f"{tmp_path / 'varied.py'}:score")
    history = _fit(tmp_path, placement(), reward=reward, env=RevealEnvironment()).history
    assert all(m["env/turns_mean"] == 2.0 for m in history)
    _assert_cut(history)


@pytest.mark.integration
@pytest.mark.slow  # engine worker processes (the policy's and the judge's)
def test_partial_rollouts_cut_the_generation_of_a_rollout_with_a_generative_judge(tmp_path, monkeypatch):
    """K = 1 with a generative judge (a tiny random one: it shows the plumbing, not judging) on one worker that swaps
    between the policy and the judge: the weight sync cuts the generation in flight of the rollout started ahead,
    which is then judged and trained with its two versions' tokens."""
    monkeypatch.setenv(HOLD_ENV, "4")
    judge = materialize(ModelConfig(**TINY), char_tokenizer(), seed=1, workdir=str(tmp_path / "judge"))
    history = _fit(tmp_path, StaticPlacement(workers=1), reward=GenerativeReward(judge)).history
    _assert_cut(history)
