"""Thread defaults (gcore/threads.py): each process's share of the usable cores, a passive OpenMP wait, and the
user's own settings winning; the engine workers gcore spawns are checked from inside the real worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gcore import threads
from gcore.engines.pool import REWARD, RoleSpec, WorkerPool
from gcore.model import ModelSource
from gcore.testing import make_sample

USER_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@pytest.fixture
def no_user_settings(monkeypatch):
    for name in USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def controller_threads():
    """Restore this process's torch threads after a test changed them."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("cores", "processes", "expected"),
                         [(2, 1, 2), (2, 2, 1), (2, 3, 1), (8, 3, 2), (16, 4, 4), (1, 1, 1)])
def test_default_threads_share_the_usable_cores(cores, processes, expected):
    assert threads.default_threads(cores, processes) == expected


def test_default_threads_refuses_no_cores_or_processes():
    with pytest.raises(ValueError, match="cores and processes must be >= 1"):
        threads.default_threads(0, 1)
    with pytest.raises(ValueError, match="cores and processes must be >= 1"):
        threads.default_threads(2, 0)


def test_usable_cores_is_the_affinity():
    assert threads.usable_cores() == len(os.sched_getaffinity(0))


def test_the_users_settings_win():
    assert threads.thread_env(3, {}) == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.thread_env(3, {"OMP_NUM_THREADS": "1"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.thread_env(3, {"OMP_WAIT_POLICY": "active"}) == {"OMP_NUM_THREADS": "3"}
    assert threads.thread_env(3, {"GOMP_SPINCOUNT": "10000"}) == {"OMP_NUM_THREADS": "3"}
    assert threads.user_threads({"OMP_NUM_THREADS": "4,2"}) == 4  # nested levels: the outermost counts
    assert threads.user_threads({"OMP_NUM_THREADS": ""}) is None
    assert threads.user_threads({"OMP_NUM_THREADS": "many"}) is None
    assert threads.user_threads({}) is None


def test_wait_policy_is_set_only_before_torch_and_only_without_the_users_own():
    env: dict[str, str] = {}
    assert threads.set_wait_policy(env, torch_imported=False) == "gcore"
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {}
    assert threads.set_wait_policy(env, torch_imported=True) == "libgomp" and env == {}  # too late: nothing set
    env = {"GOMP_SPINCOUNT": "300000"}
    assert threads.set_wait_policy(env, torch_imported=False) == "user" and env == {"GOMP_SPINCOUNT": "300000"}


def _policy_seen_by_a_fresh_process(env: dict[str, str], code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    return out.stdout.strip()


def test_importing_gcore_first_makes_openmp_wait_passively(no_user_settings):
    """The effect in a real process: gcore sets the policy before torch is imported, not after, and keeps the
    user's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    show = "import os, gcore.threads as t; print(t.wait_policy_by, os.environ.get('OMP_WAIT_POLICY'))"
    assert _policy_seen_by_a_fresh_process(env, "import gcore; " + show) == "gcore PASSIVE"
    assert _policy_seen_by_a_fresh_process(env, "import torch, gcore; " + show) == "libgomp None"
    assert _policy_seen_by_a_fresh_process({**env, "OMP_WAIT_POLICY": "active"}, "import gcore; " + show) == \
        "user active"


def test_configure_sets_this_processes_share_unless_the_user_set_one(monkeypatch, no_user_settings,
                                                                     controller_threads):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert threads.configure(processes=2) == 2 == torch.get_num_threads()
    assert threads.configure(processes=8) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(2)
    assert threads.configure(processes=1) == 2  # the user's variable already decided: gcore leaves it


def test_spawning_restores_the_environment(no_user_settings, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    with threads.spawning(2):
        assert os.environ["OMP_NUM_THREADS"] == "2" and os.environ["OMP_WAIT_POLICY"] == "active"
    assert "OMP_NUM_THREADS" not in os.environ and os.environ["OMP_WAIT_POLICY"] == "active"


class ReportThreads:
    """A rule-based "reward" that scores with what its worker process runs with: torch threads, whether OpenMP was
    told to wait passively, and the ``OMP_NUM_THREADS`` it was started with."""

    last_errors = 0

    def setup(self, device: torch.device) -> None:
        pass

    def score(self, samples) -> list[float]:
        return [float(torch.get_num_threads()), float(os.environ.get("OMP_WAIT_POLICY") == "PASSIVE"),
                float(os.environ.get("OMP_NUM_THREADS", "0"))][: len(samples)]


def _ask_workers(pool: WorkerPool) -> list[list[float]]:
    samples = [make_sample("p", "r") for _ in range(3)]
    jobs = [pool.submit("score", (REWARD, samples), [i], REWARD) for i in range(pool.size)]
    pool.wait(jobs)
    return [job.result[0] for job in jobs]  # type: ignore[index]


@pytest.mark.slow
def test_spawned_workers_get_their_share_and_the_users_settings_win(no_user_settings, controller_threads,
                                                                    monkeypatch):
    specs = {REWARD: RoleSpec(None, ModelSource(""), reward=ReportThreads())}
    torch.set_num_threads(2)  # the controller's share of the machine; its 2 workers get one thread each
    pool = WorkerPool(2, specs, [REWARD, REWARD])
    try:
        assert pool.threads == 1
        assert _ask_workers(pool) == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    finally:
        pool.close()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    pool = WorkerPool(1, specs, [REWARD])
    try:
        assert _ask_workers(pool) == [[3.0, 0.0, 3.0]]  # the user's count and wait policy, not gcore's
    finally:
        pool.close()
    assert os.environ["OMP_WAIT_POLICY"] == "active" and os.environ["OMP_NUM_THREADS"] == "3"
