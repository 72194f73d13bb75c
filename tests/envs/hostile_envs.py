"""Environments that misbehave, for tests/envs/test_env_safety.py (imported by the tests and, copied next to a
CLI run, by ``gcore fit --env hostile_envs.<Class>``)."""

import math
import os
import time

from gcore.envs import Environment, Turn


class _Marking(Environment):
    """Writes ``<pid> <parent pid>`` to ``marks`` (a file) at every call, so a test can see which processes ran
    it and check that none is left."""

    def __init__(self, marks: str = "", **kw):
        super().__init__(**kw)
        self.marks = marks

    def _mark(self):
        if self.marks:
            with open(self.marks, "a") as f:
                f.write(f"{os.getpid()} {os.getppid()}\n")


class Hangs(_Marking):
    """``step`` never returns."""

    def step(self, state, response):
        self._mark()
        time.sleep(10**6)


class SlowToStart(_Marking):
    """Its process takes 3 s to build it (unpickling sleeps), longer than the ``--env.timeout_s`` of 2 s that its
    calls are given, which answer at once."""

    def __setstate__(self, state):
        time.sleep(3)
        self.__dict__.update(state)

    def step(self, state, response):
        self._mark()
        return Turn(done=True)


class HangsInReset(_Marking):
    def reset(self, prompt):
        self._mark()
        time.sleep(10**6)

    def step(self, state, response):
        return Turn(done=True)


class Exits(_Marking):
    """Its process ends in the middle of ``step`` (a crash, ``os._exit``)."""

    def step(self, state, response):
        self._mark()
        os._exit(3)


class BadIds(Environment):
    """Observation token ids outside any vocabulary."""

    def step(self, state, response):
        return Turn(observation=[10**9, -5])


class NanReward(Environment):
    def __init__(self, reward: str = "nan", **kw):
        super().__init__(**kw)
        self.reward = reward

    def step(self, state, response):
        value = {"nan": math.nan, "inf": math.inf, "text": "0.5", "huge": 10**400}[self.reward]
        return Turn(done=True, reward=value)


class Huge(Environment):
    """An observation of ``chars`` characters each turn."""

    def __init__(self, chars: int = 5_000_000, **kw):
        kw.setdefault("max_turns", 4)
        super().__init__(**kw)
        self.chars = chars

    def step(self, state, response):
        return Turn(observation="|" * self.chars)


class ManyIds(Environment):
    """``ids`` observation tokens each turn (token ids, so no text limit applies)."""

    def __init__(self, ids: int = 100, **kw):
        kw.setdefault("max_turns", 6)
        super().__init__(**kw)
        self.ids = ids

    def step(self, state, response):
        return Turn(observation=[5] * self.ids)


class Broken(Environment):
    """Every ``step`` raises (an environment whose backing service is down): every episode ends as an error."""

    def reset(self, prompt):
        return {}

    def step(self, state, response):
        raise ConnectionError("the game server refused the connection")
