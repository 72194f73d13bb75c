"""The episode loop: token-exact trajectories, limits, errors, and generation that overlaps a slow environment."""

import threading

import pytest
import torch
from lightning.fabric import Fabric

from gcore import GRPO, HFEngine, ModelConfig, Prompt, SamplingParams, TorchBackend
from gcore.envs import Environment, Turn
from gcore.envs.episodes import EpisodeStats, run_episodes
from gcore.errors import ConfigError
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.types import collate


class Scripted(Environment):
    """Observation ``|<turn>|`` after each turn; done after ``turns`` turns (never when ``turns`` is 0)."""

    def __init__(self, turns=3, **kw):
        kw.setdefault("max_turns", 5)
        super().__init__(**kw)
        self.turns = turns

    def reset(self, prompt):
        return {"turn": 0}

    def step(self, state, response):
        state["turn"] += 1
        if self.turns and state["turn"] >= self.turns:
            return Turn(reward=0.5, done=True, metrics={"answers": 1})
        return Turn(observation=f"|{state['turn']}|", reward=0.25)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128), tokenizer, seed=0,
                       workdir=str(tmp_path_factory.mktemp("model")))
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    return tokenizer, path, engine


def _prompts(tokenizer, k=2):
    return [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"], str(i)) for i in range(k)]


class Recording:
    """An engine's ``generate`` that keeps every call's prompts and outputs."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __call__(self, prompts, params):
        outputs = self.engine.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], outputs))
        return outputs


def test_three_turn_trajectories_are_the_engines_tokens_and_the_trainers_logprobs(tiny):
    """The ids trained on are the engine's generated ids and the observations' ids, in order, each turn
    continued from the previous ids (no re-tokenization); the trainer's log-probabilities of the model
    tokens equal the engine's; observation tokens are masked out of the loss."""
    tokenizer, path, engine = tiny
    params = SamplingParams(n=2, max_new_tokens=5, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,))
    generate, stats = Recording(engine), EpisodeStats()
    samples = run_episodes(Scripted(turns=3), generate, _prompts(tokenizer), params, tokenizer, stats=stats)
    assert len(samples) == 4 and all(s.turns == 3 and s.finished for s in samples)
    assert [s.env_reward for s in samples] == [1.0] * 4  # 0.25 + 0.25 + 0.5
    assert stats.counts["answers"] == 4 and stats.counts["turns"] == 12
    for sample in samples:
        # rebuild the trajectory from what the engine returned and the observations' own tokenization
        expected, mask, logprobs, turn = [], [], [], 0
        context = sample.prompt.token_ids
        while True:
            call = next(c for c in generate.calls if context in c[0])
            row = call[0].index(context)
            gens = call[1][row]
            generation = next(g for g in gens if sample.response_ids[len(expected):][: len(g.token_ids)] == g.token_ids)
            expected += generation.token_ids
            logprobs += generation.logprobs
            mask += [1] * len(generation.token_ids)
            turn += 1
            if turn == 3:
                break
            observation = tokenizer.encode(f"|{turn}|", add_special_tokens=False)
            expected += observation
            logprobs += [0.0] * len(observation)
            mask += [0] * len(observation)
            context = sample.prompt.token_ids + expected
        assert sample.response_ids == expected
        assert sample.response_mask == mask
        assert sample.response_logprobs == logprobs
    fabric = Fabric(accelerator="cpu", devices=1)
    backend = TorchBackend()
    backend.setup(fabric, ModelSource(path), GRPO(kl_coef=0.0), embedded=True)
    batch = collate(samples, tokenizer.pad_token_id, params.temperature)
    assert int(batch.response_mask.sum()) == sum(sum(s.response_mask) for s in samples)
    trainer = backend.compute_logprobs(batch, "policy")
    gap = ((trainer - batch.engine_logprobs) * batch.response_mask).abs().max()
    assert float(gap) < 1e-4


def test_limits_truncate_an_episode(tiny):
    tokenizer, _, engine = tiny
    params = SamplingParams(n=1, max_new_tokens=4, stop_token_ids=(tokenizer.eos_token_id,))
    never_done = run_episodes(Scripted(turns=0, max_turns=3), engine.generate, _prompts(tokenizer), params, tokenizer)
    assert all(s.turns == 3 and not s.finished for s in never_done)
    stats = EpisodeStats()
    budget = run_episodes(Scripted(turns=0, max_turns=5, max_tokens=10), engine.generate, _prompts(tokenizer),
                          params, tokenizer, stats=stats)
    assert all(len(s.response_ids) <= 10 and not s.finished for s in budget)
    assert stats.counts["truncated"] == 2


class Failing(Environment):
    def __init__(self, result):
        super().__init__(max_turns=3)
        self.result = result

    def step(self, state, response):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_an_environment_that_raises_ends_its_episode_and_is_counted(tiny):
    tokenizer, _, engine = tiny
    stats = EpisodeStats()
    samples = run_episodes(Failing(RuntimeError("tool server down")), engine.generate, _prompts(tokenizer),
                           SamplingParams(n=2, max_new_tokens=3), tokenizer, stats=stats)
    assert stats.counts["errors"] == 4 and all(s.turns == 1 and not s.finished for s in samples)


@pytest.mark.parametrize("result, named", [("text", "str, not a gcore.envs.Turn"),
                                           (Turn(observation=3.5), "observation must be a str or a list")])
def test_an_environment_returning_the_wrong_type_is_one_line(tiny, result, named):
    tokenizer, _, engine = tiny
    with pytest.raises(ConfigError, match=named) as err:
        run_episodes(Failing(result), engine.generate, _prompts(tokenizer), SamplingParams(n=1, max_new_tokens=3),
                     tokenizer)
    assert "Failing" in str(err.value) and "\n" not in str(err.value)


class AsyncEnv(Scripted):
    async def step(self, state, response):
        return super().step(state, response)


def test_an_async_environment(tiny):
    tokenizer, _, engine = tiny
    samples = run_episodes(AsyncEnv(turns=2), engine.generate, _prompts(tokenizer),
                           SamplingParams(n=1, max_new_tokens=3), tokenizer)
    assert all(s.turns == 2 and s.finished for s in samples)


class SlowFirst(Scripted):
    """Episode 0's first step returns only once the engine has generated another turn for the others:
    it can finish only when generation overlaps the wait (or at ``timeout_s``)."""

    def __init__(self, generate, **kw):
        super().__init__(turns=3, **kw)
        self.generate, self.first = generate, threading.Lock()

    def reset(self, prompt):
        return {"turn": 0, "slow": prompt.index == 0}

    def step(self, state, response):
        if state["slow"] and state["turn"] == 0:
            calls = len(self.generate.calls)
            for _ in range(400):  # up to 20 s; the engine's next turn batch ends the wait
                if len(self.generate.calls) > calls:
                    break
                threading.Event().wait(0.05)
            else:
                raise TimeoutError("the engine generated nothing while this step waited")
        return super().step(state, response)


@pytest.mark.parametrize("overlap", [True, False])
def test_generation_goes_on_while_one_episode_waits_for_its_environment(tiny, overlap):
    tokenizer, _, engine = tiny
    generate, stats = Recording(engine), EpisodeStats()
    env = SlowFirst(generate, overlap=overlap, timeout_s=3.0)
    samples = run_episodes(env, generate, _prompts(tokenizer, 3), SamplingParams(n=1, max_new_tokens=3), tokenizer,
                           stats=stats)
    if overlap:  # the others' turns were generated while episode 0 waited: it then finished its 3 turns
        assert stats.counts.get("errors", 0) == 0 and all(s.turns == 3 for s in samples)
    else:  # one batch per turn: nothing is generated while it waits, so it fails (raises or times out)
        assert stats.counts["errors"] == 1 and samples[0].turns == 1


def test_gae_skips_observation_tokens():
    """A model token followed by an observation bootstraps from the next model token's value, as if the
    observation were not there (not from 0, as at the end of a response)."""
    from gcore.algorithms.base import gae

    rewards, values = torch.tensor([[0.0, 0.0, 0.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.25, 0.75]])
    holes, _ = gae(rewards, values, torch.tensor([[1.0, 0.0, 1.0, 1.0]]), 1.0, 1.0)
    dense, _ = gae(rewards[:, [0, 2, 3]], values[:, [0, 2, 3]], torch.ones(1, 3), 1.0, 1.0)
    torch.testing.assert_close(holes[:, [0, 2, 3]], dense)
    assert holes[0, 1] == 0
