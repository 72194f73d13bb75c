"""An environment cannot take a run down or hang it: observation ids and sizes, turn rewards, a ``step`` or
``reset`` that never returns or whose process dies (docs/failure-modes.md, "Environments")."""

import csv
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_hf_engine
from hostile_envs import BadIds, Broken, Exits, Hangs, HangsInReset, Huge, ManyIds, NanReward, SlowToStart

from gcore import ModelConfig, Prompt, SamplingParams
from gcore.envs.episodes import EpisodeStats, close_runner, env_runner, run_episodes
from gcore.errors import ConfigError, RewardError

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer, path, engine = tiny_hf_engine(tmp_path_factory.mktemp("model"), layers=1, hidden=32, intermediate=64)
    return tokenizer, engine


def _run(tiny, env, n=2, prompts=2, stats=None):
    tokenizer, engine = tiny
    items = [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"], str(i), source=f"data.jsonl:{i + 1}")
             for i in range(prompts)]
    try:
        return run_episodes(env, engine.generate, items, SamplingParams(n=n, max_new_tokens=3), tokenizer,
                            stats=stats)
    finally:
        close_runner(env)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _marks(path):
    return [tuple(map(int, line.split())) for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_observation_ids_outside_the_vocabulary_are_one_line(tiny, isolation):
    with pytest.raises(ConfigError) as err:
        _run(tiny, BadIds(isolation=isolation))
    message = str(err.value)
    assert "\n" not in message and "hostile_envs.BadIds" in message and "token id 1000000000" in message
    assert f"0..{len(tiny[0]) - 1}" in message and "of prompt data.jsonl:" in message


@pytest.mark.parametrize("reward, named", [("nan", "must be finite, got nan"), ("inf", "must be finite, got inf"),
                                           ("text", "must be a number, got str"),
                                           ("huge", "within float32's range")])
def test_a_bad_turn_reward_is_one_line_naming_the_environment_and_the_sample(tiny, reward, named):
    with pytest.raises(RewardError) as err:
        _run(tiny, NanReward(reward=reward))
    message = str(err.value)
    assert "\n" not in message and named in message
    assert "--env hostile_envs.NanReward: turn 1's reward" in message
    assert re.search(r"on episode [12] of 2 of prompt data\.jsonl:[12]: '[01]='$", message), message


def test_an_observation_over_the_character_limit_ends_its_episode(tiny):
    stats = EpisodeStats()
    samples = _run(tiny, Huge(chars=5_000_000), stats=stats)  # the default limit: 100,000 characters
    assert stats.counts["errors"] == 4 and stats.counts["oversized"] == 4
    assert all(s.turns == 1 and not s.finished and len(s.response_ids) <= 3 for s in samples)
    assert "observation of 5000000 characters, more than --env.max_observation_chars 100000" in stats.first_error
    assert re.search(r"on episode [12] of 2 of prompt data\.jsonl:[12]: '[01]='", stats.first_error)
    # within the limit it is taken (and truncated by max_turns as before)
    stats = EpisodeStats()
    samples = _run(tiny, Huge(chars=50, max_turns=2), stats=stats)
    assert stats.counts.get("errors", 0) == 0 and all(s.turns == 2 for s in samples)


def test_observation_tokens_per_episode_are_limited(tiny):
    stats = EpisodeStats()
    samples = _run(tiny, ManyIds(ids=100, max_observation_tokens=250), stats=stats)
    # two observations of 100 fit, the third would make 300 tokens; the context tokens are those 200 and the EOS
    # closing each turn cut at the 3-token budget before them (docs/agents.md, "A turn cut at the token budget")
    eos = tiny[0].eos_token_id
    for s in samples:
        context = [t for t, m in zip(s.response_ids, s.response_mask, strict=True) if not m]
        assert s.turns == 3 and context.count(5) == 200 and len(context) - 200 == context.count(eos) <= 2
    assert stats.counts["oversized"] == 4
    assert "more than --env.max_observation_tokens 250 per episode" in stats.first_error
    stats = EpisodeStats()
    _run(tiny, ManyIds(ids=100, max_observation_tokens=0), stats=stats)  # 0: no limit
    assert "oversized" not in stats.counts and stats.counts["truncated"] == 4


def test_a_step_that_never_returns_is_killed_with_its_process(tiny, tmp_path):
    marks = tmp_path / "marks"
    env = Hangs(marks=str(marks), timeout_s=2.0, workers=4)
    stats = EpisodeStats()
    samples = _run(tiny, env, stats=stats)
    assert stats.counts["errors"] == 4 and stats.counts["timeouts"] == 4
    assert all(s.turns == 1 and not s.finished for s in samples)
    assert "Hangs.step did not return within --env.timeout_s 2 s on episode" in stats.first_error
    assert "was killed" in stats.first_error
    pids = {pid for pid, _ in _marks(marks)}
    assert len(pids) >= 1 and os.getpid() not in pids  # it ran in other processes, all of them gone
    assert not [pid for pid in pids if _alive(pid)]


def test_a_slow_process_start_is_not_a_call_timeout(tiny, tmp_path):
    """``--env.timeout_s`` times the environment's calls, not its process's start: a child that takes 3 s to build the
    environment (a busy machine, a slow import) answers calls given 2 s each (before: every episode's first call
    timed out, its process killed)."""
    marks = tmp_path / "marks"
    env = SlowToStart(marks=str(marks), timeout_s=2.0, workers=1)
    stats = EpisodeStats()
    samples = _run(tiny, env, stats=stats)
    assert not stats.counts.get("errors") and not stats.counts.get("timeouts"), stats.first_error
    assert all(s.finished for s in samples) and len(_marks(marks)) == 4


def test_a_reset_that_never_returns_ends_its_episode(tiny, tmp_path):
    marks = tmp_path / "marks"
    stats = EpisodeStats()
    samples = _run(tiny, HangsInReset(marks=str(marks), timeout_s=2.0), stats=stats)
    assert stats.counts["errors"] == 4 and stats.counts["timeouts"] == 4 and "reset did not return" in \
        stats.first_error
    assert all(s.turns == 1 for s in samples)
    assert not [pid for pid, _ in _marks(marks) if _alive(pid)]


def test_an_environment_process_that_dies_ends_only_its_episode(tiny, tmp_path):
    stats = EpisodeStats()
    env = Exits(marks=str(tmp_path / "marks"))
    _run(tiny, env, stats=stats)
    assert stats.counts["errors"] == 4
    assert "Exits.step its process ended (exit code 3)" in stats.first_error


def test_the_environment_processes_are_reused_and_closed(tiny):
    from conftest import Scripted

    env = Scripted(turns=3, workers=2)
    tokenizer, engine = tiny
    items = [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"], str(i)) for i in range(2)]
    for _ in range(2):
        samples = run_episodes(env, engine.generate, items, SamplingParams(n=2, max_new_tokens=3), tokenizer)
        assert all(s.turns == 3 and s.finished and s.env_reward == 1.0 for s in samples)
    runner = env_runner(env)
    assert runner is not None and 1 <= runner.started <= 2 and runner.killed == 0  # no new process per rollout
    pids = runner.children()
    assert pids and all(_alive(pid) for pid in pids)
    close_runner(env)
    assert not [pid for pid in pids if _alive(pid)]


def test_an_unpicklable_environment_is_one_line(tiny):
    import threading

    env = BadIds()
    env.lock = threading.Lock()
    with pytest.raises(ConfigError, match="cannot be sent to its own process .*--env.isolation thread"):
        _run(tiny, env)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_run_whose_environment_hangs_finishes_and_exits(tmp_path, isolation):
    """``gcore fit`` with an environment whose ``step`` sleeps for ever: every episode times out, the run trains
    its steps, writes ``final/`` and exits 0, with no process of it left (before, it never exited)."""
    shutil.copy(HERE / "hostile_envs.py", tmp_path / "hostile_envs.py")
    marks = tmp_path / "marks"
    cmd = [sys.executable, "-m", "gcore", "fit", "--env", "hostile_envs.Hangs", "--env.marks", str(marks),
           "--env.timeout_s", "2", "--env.isolation", isolation, "--trainer.max_steps", "2",
           "--trainer.enable_progress_bar", "false", "--data.prompts_per_step", "2", "--sampling.n", "2",
           "--sampling.max_new_tokens", "4", "--trainer.default_root_dir", str(tmp_path / "runs")]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Hangs.step did not return within --env.timeout_s 2 s" in run.stderr
    assert list((tmp_path / "runs").glob("**/final/config.json"))
    marked = _marks(marks)  # (the process that ran the step, its parent: the forkserver, or this test)
    pids = {pid for pid, _ in marked} | ({parent for _, parent in marked} if isolation == "process" else set())
    assert pids and os.getpid() not in pids and not [pid for pid in pids if _alive(pid)]


@pytest.mark.parametrize("env, error", [
    (lambda: Huge(chars=200_000), None),
    (lambda: NanReward(), RewardError),
    (lambda: BadIds(), ConfigError),
], ids=["huge", "nan-reward", "bad-ids"])
def test_through_the_trainer(tmp_path, env, error):
    """Whole runs: a huge observation ends its episodes and the run trains on (``env/oversized``); a NaN turn
    reward and out-of-vocabulary ids stop it with the one-line error (before: memory without bound, tracebacks)."""
    from gcore import Trainer, TrainerConfig
    from gcore.data import DataConfig

    trainer = Trainer(trainer=TrainerConfig(max_steps=2, default_root_dir=str(tmp_path), enable_progress_bar=False,
                                            save_final=False),
                      model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
                      data=DataConfig(prompts_per_step=2), sampling=SamplingParams(n=2, max_new_tokens=4), env=env())
    if error is None:
        history = trainer.fit().history
        assert len(history) == 2 and all(m["env/oversized"] == 4 and m["env/errors"] == 4 for m in history)
    else:
        with pytest.raises(error, match="--env hostile_envs"):
            trainer.fit()


@pytest.mark.parametrize("limit", [3, 0])
def test_a_run_whose_every_episode_fails_stops_after_the_limit(tmp_path, limit):
    """Before: a run whose environment failed every call trained on to its last step on nothing but errors
    (reward 0, exit 0), with a warning per rollout. Now it stops after ``--trainer.max_failed_env_steps`` such steps
    in a row, in one line; 0 keeps the old behaviour."""
    from gcore import Trainer, TrainerConfig
    from gcore.data import DataConfig
    from gcore.errors import GcoreError

    trainer = Trainer(trainer=TrainerConfig(max_steps=5, default_root_dir=str(tmp_path), enable_progress_bar=False,
                                            save_final=False, max_failed_env_steps=limit),
                      model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
                      data=DataConfig(prompts_per_step=2), sampling=SamplingParams(n=2, max_new_tokens=4),
                      env=Broken(isolation="thread"))
    if limit:
        with pytest.raises(GcoreError) as err:
            trainer.fit()
        assert str(err.value) == ("step 2: every episode of the last 3 steps ended on an environment error (4 of 4 "
                                  "on this step; the warnings above name each rollout's first error); stopping (see "
                                  "--trainer.max_failed_env_steps)")
        rows = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()
        assert len(rows) == 1 + 3  # the header and the three steps, logged before the stop
    else:
        history = trainer.fit().history
        assert len(history) == 5 and all(m["env/errors"] == m["env/episodes"] == 4 for m in history)


@pytest.mark.integration
def test_environment_processes_import_this_gcore_beside_a_gcore_run_folder(tmp_path):
    """A user's environment in the working directory (``from gcore import Environment``), runs written to
    ``./gcore/`` (``--trainer.default_root_dir .``), gcore installed editable (an import hook, as CI and a developer
    install it). Before: in the first run, the environment's processes (started once ``./gcore/`` existed) imported
    that folder as a namespace package, and every episode ended on ``ImportError: cannot import name 'Environment'
    from 'gcore' (unknown location)``; in a second run, ``python -m gcore`` itself did, and refused the option."""
    (tmp_path / "my_env.py").write_text(textwrap.dedent("""
        from gcore import Environment, Turn

        class Twice(Environment):
            def reset(self, prompt):
                return {"turn": 0}

            def step(self, state, response):
                state["turn"] += 1
                return Turn(observation="|", reward=0.5, done=state["turn"] == 2, metrics={"mine": 1.0})
    """))
    tiny = ["--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false", "--data.prompts_per_step", "2",
            "--sampling.n", "2", "--sampling.max_new_tokens", "4", "--model.num_hidden_layers", "1",
            "--model.hidden_size", "32", "--model.intermediate_size", "64"]
    for version in (0, 1):  # the first run makes ./gcore/; the second starts beside it
        run = subprocess.run([sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", ".", *tiny,
                              "--env", "my_env.Twice", "--env.isolation", "process"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        assert "ImportError" not in run.stderr and "environment error" not in run.stderr, run.stderr[-3000:]
        with (tmp_path / "gcore" / f"version_{version}" / "metrics.csv").open() as f:
            metrics = next(csv.DictReader(f))
        # every episode ran both turns in the environment's own processes
        assert float(metrics["env/episodes"]) == 4 and float(metrics["env/mine"]) == 8, metrics
        assert float(metrics.get("env/errors") or 0) == 0, metrics
