"""The episode loop: token-exact trajectories, limits, errors, and generation that overlaps a slow environment."""

import threading

import pytest
import torch
from conftest import Recording, Scripted, three_turn_trajectory_gap, tiny_hf_engine
from lightning_fabric import Fabric

from gcore import GRPO, Prompt, SamplingParams, TorchBackend
from gcore.envs import Environment, Turn
from gcore.envs.episodes import EpisodeStats, run_episodes
from gcore.errors import ConfigError
from gcore.model import ModelSource


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer, path, engine = tiny_hf_engine(tmp_path_factory.mktemp("model"))
    return tokenizer, path, engine


def _prompts(tokenizer, k=2):
    return [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"], str(i)) for i in range(k)]


def test_three_turn_trajectories_are_the_engines_tokens_and_the_trainers_logprobs(tiny):
    """The ids trained on are the engine's generated ids and the observations' ids, in order, each turn
    continued from the previous ids (no re-tokenization); the trainer's log-probabilities of the model
    tokens equal the engine's; observation tokens are masked out of the loss (the same check runs for
    vLLM and SGLang in their CI parts: tests/engines/)."""
    tokenizer, path, engine = tiny
    backend = TorchBackend()
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=True)
    gap, samples = three_turn_trajectory_gap(engine, backend, tokenizer)
    assert len(samples) == 4 and all(s.turns == 3 and s.finished for s in samples)
    assert [s.env_reward for s in samples] == [1.0] * 4  # 0.25 + 0.25 + 0.5
    assert gap < 1e-4


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
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


@pytest.mark.parametrize("error", [RuntimeError("tool server down"), SystemExit(0), KeyboardInterrupt()],
                         ids=["exception", "exit", "interrupt"])
def test_an_environment_that_raises_ends_its_episode_and_is_counted(tiny, error):
    """Even ``SystemExit`` or ``KeyboardInterrupt`` from the environment's own code: its episodes end, the run
    goes on (a real Ctrl-C reaches the main thread, not the environment's)."""
    tokenizer, _, engine = tiny
    stats = EpisodeStats()
    samples = run_episodes(Failing(error), engine.generate, _prompts(tokenizer),
                           SamplingParams(n=2, max_new_tokens=3), tokenizer, stats=stats)
    assert stats.counts["errors"] == 4 and all(s.turns == 1 and not s.finished for s in samples)
    assert stats.first_error is not None and type(error).__name__ in stats.first_error


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
    it can finish only when generation overlaps the wait (or at ``timeout_s``). It watches the engine through
    a file the test's ``generate`` writes (it may run in a process of its own)."""

    def __init__(self, calls_file, **kw):
        super().__init__(turns=3, **kw)
        self.calls_file = str(calls_file)

    def reset(self, prompt):
        return {"turn": 0, "slow": prompt.index == 0}

    def _calls(self):
        with open(self.calls_file) as f:
            return len(f.read())

    def step(self, state, response):
        if state["slow"] and state["turn"] == 0:
            calls = self._calls()
            for _ in range(400):  # up to 20 s; the engine's next turn batch ends the wait
                if self._calls() > calls:
                    break
                threading.Event().wait(0.05)
            else:
                raise TimeoutError("the engine generated nothing while this step waited")
        return super().step(state, response)


class Marking(Recording):
    """``Recording`` that also appends a character to a file per call (for an environment in another process)."""

    def __init__(self, engine, path):
        super().__init__(engine)
        self.path = path
        path.write_text("")

    def __call__(self, prompts, params):
        outputs = super().__call__(prompts, params)
        with open(self.path, "a") as f:
            f.write("x")
        return outputs


@pytest.mark.parametrize("isolation", ["process", "thread"])
@pytest.mark.parametrize("overlap", [True, False])
def test_generation_goes_on_while_one_episode_waits_for_its_environment(tiny, tmp_path, overlap, isolation):
    tokenizer, _, engine = tiny
    generate, stats = Marking(engine, tmp_path / "calls"), EpisodeStats()
    # timeout_s well past SlowFirst's own 20 s wait: the verdict comes from whether generation went on (the
    # step's own wait), never from how fast a loaded machine starts the environment's process
    env = SlowFirst(tmp_path / "calls", overlap=overlap, timeout_s=120.0, isolation=isolation)
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
