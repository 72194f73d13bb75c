"""Thread defaults (gcore/threads.py): each process's share of the usable cores, a passive OpenMP wait, and the
user's own settings winning; the engine workers gcore spawns are checked from inside the real worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from gcore import threads
from gcore.engines.pool import REWARD, RoleSpec, WorkerPool
from gcore.environ import environ_set
from gcore.model import ModelSource
from gcore.testing import make_sample

USER_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", threads.USER_THREADS_VARIABLE)


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


def test_a_launched_controller_reads_the_users_choice_from_its_launcher():
    variable = threads.USER_THREADS_VARIABLE
    assert threads.user_threads({"OMP_NUM_THREADS": "1", variable: ""}) is None  # Fabric's share, not the user's
    assert threads.user_threads({"OMP_NUM_THREADS": "1", variable: "3"}) == 3
    assert threads.thread_env(2, {"OMP_NUM_THREADS": "1", variable: ""})["OMP_NUM_THREADS"] == "2"


def _imported_settings(env: dict[str, str]) -> list[str]:
    """What a fresh process that imports gcore decides: the user's count, the wait it set, whether it adapts."""
    code = ("from gcore import threads; "
            "print(threads.user_threads_at_import, threads.wait or '-', threads.governor('cpu') is not None)")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.mark.integration
def test_controllers_fabric_launches_adapt_their_share(no_user_settings, monkeypatch):
    """Lightning Fabric gives each controller it launches ``OMP_NUM_THREADS`` = its share of the cores; launched
    inside ``threads.launching()`` (as ``Trainer.fit`` does), that controller adapts its count and spins briefly like
    the launching process, instead of taking Fabric's share for the user's fixed choice."""
    with threads.launching():
        assert _imported_settings({"OMP_NUM_THREADS": "1"}) == ["None", "GOMP_SPINCOUNT=30000", "True"]
    # the same variable set by the user, with no launcher between: a fixed count, threads sleep at once
    assert _imported_settings({"OMP_NUM_THREADS": "1"}) == ["1", "OMP_WAIT_POLICY=PASSIVE", "False"]
    monkeypatch.setattr(threads, "user_threads_at_import", 3)  # the user's own, in the launching process
    with threads.launching():
        assert _imported_settings({"OMP_NUM_THREADS": "3"}) == ["3", "OMP_WAIT_POLICY=PASSIVE", "False"]
    assert threads.USER_THREADS_VARIABLE not in os.environ


def test_wait_policy_is_set_only_before_torch_and_only_without_the_users_own():
    env: dict[str, str] = {}
    assert threads.set_wait_policy(env, torch_imported=False) == "gcore"
    assert env == {"GOMP_SPINCOUNT": threads.SPIN_COUNT}  # an adaptive count: a bounded spin
    env = {"OMP_NUM_THREADS": "2"}
    assert threads.set_wait_policy(env, torch_imported=False) == "gcore"
    assert env == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}  # a fixed count: sleep at once
    env = {}
    assert threads.set_wait_policy(env, torch_imported=True) == "libgomp" and env == {}  # too late: nothing set
    env = {"GOMP_SPINCOUNT": "300000"}
    assert threads.set_wait_policy(env, torch_imported=False) == "user" and env == {"GOMP_SPINCOUNT": "300000"}


def test_what_gcore_leaves_in_the_environment_once_torch_is_imported(monkeypatch):
    """``gcore/__init__``'s two calls on an environment as a fresh process would see it (the fresh process of
    ``test_importing_gcore_first_sets_the_wait_before_torch`` runs them on the real one, without and with torch first):
    a fixed thread count keeps gcore's passive wait; the user's own settings stay, gcore's own spin count too."""
    monkeypatch.setattr(threads, "wait_policy_by", "libgomp")
    monkeypatch.setattr(threads, "wait", "")

    def imported(env: dict[str, str]) -> tuple[str, str, dict[str, str]]:
        by = threads.set_wait_policy(env, torch_imported=False)
        threads.forget_spin_count(env)
        return by, threads.wait, env

    assert imported({"OMP_NUM_THREADS": "1"}) == (
        "gcore", "OMP_WAIT_POLICY=PASSIVE", {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"})
    monkeypatch.setattr(threads, "wait", "")
    assert imported({"OMP_WAIT_POLICY": "active"}) == ("user", "", {"OMP_WAIT_POLICY": "active"})
    # the user's own setting, even of gcore's value, stays: only the spin count gcore set itself is taken out
    assert imported({"GOMP_SPINCOUNT": threads.SPIN_COUNT}) == ("user", "", {"GOMP_SPINCOUNT": threads.SPIN_COUNT})
    assert imported({}) == ("gcore", f"GOMP_SPINCOUNT={threads.SPIN_COUNT}", {})


def _policy_seen_by_a_fresh_process(env: dict[str, str], code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    return out.stdout.strip()


@pytest.mark.integration
def test_importing_gcore_first_sets_the_wait_before_torch(no_user_settings):
    """The effect in a real process: gcore sets the wait before torch is imported, not after, and takes its own spin
    count out of the environment once torch read it (the processes it starts choose their own). Two fresh processes
    (each imports gcore: 12-18 s on the 2 cores): the other environments, a fixed thread count and the user's own
    settings, go through the same two calls, in ``test_what_gcore_leaves_in_the_environment_once_torch_is_imported``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    show = ("import os, gcore.threads as t; print(t.wait_policy_by, t.wait, os.environ.get('GOMP_SPINCOUNT'), "
            "os.environ.get('OMP_WAIT_POLICY'))")
    assert _policy_seen_by_a_fresh_process(env, "import gcore; " + show) == "gcore GOMP_SPINCOUNT=30000 None None"
    assert _policy_seen_by_a_fresh_process(env, "import torch, gcore; " + show) == "libgomp  None None"


def test_free_threads_leaves_the_cores_others_took():
    assert threads.free_threads(0.0, cores=2, ceiling=2) == 2  # quiet: the whole share
    assert threads.free_threads(0.2, cores=2, ceiling=2) == 2  # under TAKEN_FROM of a core: background noise
    assert threads.free_threads(threads.TAKEN_FROM, cores=2, ceiling=2) == 1  # a core taken
    assert threads.free_threads(1.0, cores=2, ceiling=2) == 1  # a busy loop on one core
    assert threads.free_threads(2.0, cores=2, ceiling=2) == 1  # never below one
    assert threads.free_threads(1.0, cores=8, ceiling=4) == 4  # 7 free cores, but the share is 4
    assert threads.free_threads(5.5, cores=8, ceiling=4) == 2
    assert threads.free_threads(0.0, cores=8, ceiling=1) == 1  # the user's torch.set_num_threads(1) is the most


class FakeMachine:
    """Readings of a 2-core machine that the test advances: per interval, the cores other processes used and the
    cores this process tree used."""

    def __init__(self) -> None:
        self.now, self.reading, self.reads = 0.0, threads.CpuReading(busy=0.0, total=0.0, own=0.0), 0

    def advance(self, seconds: float, others: float, own: float) -> None:
        r = self.reading
        self.now += seconds
        self.reading = threads.CpuReading(busy=r.busy + (others + own) * seconds, total=r.total + 2 * seconds,
                                          own=r.own + own * seconds)

    def read(self) -> threads.CpuReading:
        self.reads += 1
        return self.reading


def test_governor_follows_the_cores_other_processes_leave_free():
    machine, calls = FakeMachine(), []
    gov = threads.ThreadGovernor(2, read=machine.read, set_threads=calls.append, clock=lambda: machine.now, cores=2)
    machine.advance(1.0, others=0.05, own=2.0)  # quiet: this process's own two busy threads are not "others"
    assert gov.update() == 2 and calls == [] and gov.others == pytest.approx(0.05)
    machine.advance(1.0, others=1.0, own=1.0)  # a busy loop arrives
    assert gov.update() == 1 and calls == [1] and gov.others == pytest.approx(1.0)
    machine.advance(1.0, others=0.9, own=1.0)
    assert gov.update() == 1 and calls == [1]  # no change, no call
    machine.advance(1.0, others=0.0, own=1.0)  # it left
    assert gov.update() == 2 and calls == [1, 2]
    machine.advance(1.0, others=1.0, own=1.0)
    assert gov.update() == 1
    gov.restore()
    assert gov.threads == 2 and calls == [1, 2, 1, 2]


def test_governor_reads_no_interval_shorter_than_the_minimum():
    machine = FakeMachine()
    gov = threads.ThreadGovernor(2, read=machine.read, set_threads=lambda n: None, clock=lambda: machine.now, cores=2)
    machine.advance(threads.MIN_INTERVAL_S / 2, others=2.0, own=0.0)
    assert gov.update() == 2 and machine.reads == 1  # only the reading at construction
    machine.advance(threads.MIN_INTERVAL_S, others=2.0, own=0.0)
    assert gov.update() == 1 and machine.reads == 2  # over the whole 1.5 minimum intervals


def test_governor_is_off_where_the_user_chose_the_count_or_off_the_cpu(monkeypatch, controller_threads):
    monkeypatch.setattr(threads, "user_threads_at_import", None)
    torch.set_num_threads(1)  # the user's own count before fit: the most the governor uses
    gov = threads.governor("cpu")
    assert gov is not None and gov.ceiling == 1
    assert threads.governor("cuda") is None
    monkeypatch.setattr(threads, "user_threads_at_import", 2)  # OMP_NUM_THREADS when gcore was imported
    assert threads.governor("cpu") is None


def test_fit_runs_each_stage_with_the_threads_the_governor_leaves(monkeypatch, tmp_path, controller_threads):
    """A real (tiny) fit next to a recorded busy neighbour: every step ran with one thread, said so in its metrics,
    and the controller's share was back after the run."""
    from gcore import GRPO, Trainer, TrainerConfig

    machine = FakeMachine()

    def read() -> threads.CpuReading:
        machine.advance(1.0, others=1.0, own=1.0)  # a busy loop on one of 2 cores, in every interval
        return machine.read()

    monkeypatch.setattr(threads, "user_threads_at_import", None)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "read_cpu", read)
    monkeypatch.setattr(threads, "MIN_INTERVAL_S", 0.0)  # every stage re-reads: no dependence on wall time
    torch.set_num_threads(2)
    result = Trainer(trainer=TrainerConfig(max_steps=2, accelerator="cpu", default_root_dir=str(tmp_path),
                                           enable_progress_bar=False, save_final=False),
                     algorithm=GRPO()).fit()
    assert [row["threads/torch"] for row in result.history] == [1.0, 1.0]
    assert [row["threads/others_cores"] for row in result.history] == [pytest.approx(1.0)] * 2
    assert torch.get_num_threads() == 2


@pytest.mark.integration
def test_read_cpu_counts_this_processes_work_and_its_children():
    before, start = threads.read_cpu(), time.process_time()
    while time.process_time() - start < 0.3:  # CPU time, not wall time: the same on a loaded machine
        pass
    after = threads.read_cpu()
    assert 0.2 <= after.own - before.own <= 0.5  # clock ticks of 10 ms: 0.3 s within a few ticks
    assert after.busy - before.busy >= after.own - before.own - 0.05
    assert after.total >= after.busy
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert str(child.pid) in threads._descendants("self")
    finally:
        child.kill()
        child.wait()


def test_environ_set_restores_each_variable(monkeypatch):
    monkeypatch.setenv("GCORE_TEST_KEPT", "old")
    monkeypatch.delenv("GCORE_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), environ_set({"GCORE_TEST_KEPT": "new", "GCORE_TEST_NEW": "1"}):
        assert os.environ["GCORE_TEST_KEPT"] == "new" and os.environ["GCORE_TEST_NEW"] == "1"
        raise RuntimeError
    assert os.environ["GCORE_TEST_KEPT"] == "old" and "GCORE_TEST_NEW" not in os.environ


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


@pytest.mark.integration
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
