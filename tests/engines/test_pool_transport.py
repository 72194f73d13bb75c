"""The engine-worker pool against a hostile or careless local process (gcore/engines/pool/): a client that connects
to a worker's port before the controller and stays silent, or sends garbage; a worker killed while the controller
waits on it; the weight file's mode; the worker's environment."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from gcore.engines.pool import REWARD, RoleSpec, WorkerPool
from gcore.errors import GcoreError
from gcore.model import ModelSource
from gcore.testing import make_sample

pytestmark = pytest.mark.integration

TIMEOUT_S = 2.0  # the pool's liveness timeout in these tests (30 s in a run)
# a guard against the stall itself: without the fix the test would hang until pytest's timeout, and fails then
HANG = pytest.mark.timeout(300)


class Echo:
    """A rule-based reward that scores a sample by its response's length, in the worker process."""

    last_errors = 0

    def setup(self, device: torch.device) -> None:
        pass

    def score(self, samples) -> list[float]:
        return [float(len(s.response_ids)) for s in samples]


class Stuck(Echo):
    """A reward that never returns (its worker is killed while the controller waits on it)."""

    def score(self, samples) -> list[float]:
        time.sleep(3600)
        return []


class Environ(Echo):
    """A reward that reports, for each sample's response (a variable's name), whether the worker's environment holds
    that variable: in ``os.environ`` (1), also in the environment the process was started with (2), or not (0)."""

    def score(self, samples) -> list[float]:
        with open("/proc/self/environ", "rb") as f:
            started_with = {item.split(b"=", 1)[0].decode() for item in f.read().split(b"\0") if item}
        names = ["".join(map(chr, s.response_ids)) for s in samples]
        return [float(name in os.environ) + float(name in started_with) for name in names]


def pool_of(reward: Echo, size: int = 1, **kwargs) -> WorkerPool:
    return WorkerPool(size, {REWARD: RoleSpec(None, ModelSource(""), reward=reward)}, [REWARD] * size, threads=1,
                      liveness_timeout_s=TIMEOUT_S, **kwargs)


def score(pool: WorkerPool, responses: list[str], worker: int = 0) -> list[float]:
    job = pool.submit("score", (REWARD, [make_sample("p", r) for r in responses]), [worker], REWARD)
    pool.wait([job])
    return job.result[0]  # type: ignore[index]


@pytest.fixture
def squatters(monkeypatch):
    """Clients that connect to every worker's port the moment the worker says it listens, before the controller
    does (as a local process watching ``ss`` can), each then doing ``act(sock)``."""
    opened: list[socket.socket] = []
    acts = []
    wait_ready = WorkerPool._wait_ready

    def first(pool: WorkerPool, indices) -> None:
        wait_ready(pool, indices)
        for i in indices:
            for act in acts:
                sock = socket.create_connection(pool._addresses[i])
                opened.append(sock)
                act(sock)

    monkeypatch.setattr(WorkerPool, "_wait_ready", first)
    yield acts, opened
    for sock in opened:
        sock.close()


@HANG
def test_a_silent_client_that_connects_first_does_not_stall_the_controller(squatters, capfd):
    # before: the worker authenticated connections one at a time without a deadline, so it waited on the silent
    # client for ever, and the controller waited for ever in Client() behind it in the listen backlog
    acts, opened = squatters
    acts.append(lambda sock: None)  # connects, sends nothing
    pool = pool_of(Echo())
    try:
        assert score(pool, ["ab", "abcd"]) == [2.0, 4.0]  # the pool started and serves
        silent = opened[0]
        silent.settimeout(120)
        received = b""
        while chunk := silent.recv(4096):  # the worker's challenge, then the end: it dropped the silent client
            received += chunk
        assert b"#CHALLENGE#" in received
        assert score(pool, ["abc"]) == [3.0]
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert f"did not complete the authentication handshake within {TIMEOUT_S:g}s" in err, err


@HANG
def test_a_client_that_sends_garbage_does_not_end_the_worker(squatters, capfd):
    # before: the worker's Listener.accept() raised AuthenticationError (or "bad message length"), which ended it
    acts, opened = squatters
    acts.append(lambda sock: sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))  # not even framed
    acts.append(lambda sock: sock.sendall(len(b"x" * 16).to_bytes(4, "big") + b"x" * 16))  # a wrong digest
    pool = pool_of(Echo())
    try:
        assert score(pool, ["ab"]) == [2.0]
        assert pool.alive(0)
        assert score(pool, ["abcde"]) == [5.0]  # and goes on serving
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert err.count("dropped a connection from 127.0.0.1") == 2, err
    assert "failed authentication" in err


@HANG
def test_a_worker_killed_while_the_controller_waits_is_reported_in_one_line(caplog):
    # before: "engine worker 0 failed on a score request (it died (exit code -9))": no pid, no signal name
    pool = pool_of(Stuck(), retries=0)
    try:
        pid = pool.processes[0].pid
        job = pool.submit("score", (REWARD, [make_sample("p", "r")]), [0], REWARD)
        os.kill(pid, signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="gcore.engines.pool"):
            with pytest.raises(GcoreError) as raised:
                pool.wait([job])
    finally:
        pool.close()
    assert f"pid {pid} was killed by SIGKILL" in str(raised.value)
    reports = [r.getMessage() for r in caplog.records if f"pid {pid}" in r.getMessage()]
    assert reports, caplog.text
    report = reports[0]
    assert "\n" not in report and report.startswith("engine worker 0 ") and "was killed by SIGKILL" in report, report
    assert "while this controller waited on its score request" in report


def test_the_weight_file_is_readable_by_its_user_alone_while_the_pool_lives():
    # before: open(path, "wb") under the default umask: -rw-r--r--, every local user could read the policy
    pool = pool_of(Echo())
    try:
        pool.sync_weights([("w", torch.arange(6, dtype=torch.float32))])
        assert pool.weights is not None
        path = pool.weights.path
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, oct(mode)
        assert score(pool, ["a"]) == [1.0]
    finally:
        pool.close()
    assert not os.path.exists(path)


EXITS = {
    "an exception": "raise RuntimeError('the step failed')",
    # the handler set first: a process started with SIGINT ignored (as a test runner's worker may start it) keeps it so
    "Ctrl-C": "signal.signal(signal.SIGINT, signal.default_int_handler); signal.raise_signal(signal.SIGINT); "
              "time.sleep(60)",
}


@pytest.mark.parametrize("how", list(EXITS))
def test_the_weight_file_is_removed_when_the_program_ends_without_closing_the_pool(how, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        import torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_pool_transport import Echo, pool_of
        pool = pool_of(Echo())
        pool.sync_weights([("w", torch.ones(4))])
        print(pool.weights.path, flush=True)
        {EXITS[how]}
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0, done.stderr
    path = done.stdout.split()[0]
    assert path.startswith("/dev/shm/gcore-weights-")
    assert not os.path.exists(path), f"{how}: {path} left behind"


def test_workers_get_a_clean_environment(monkeypatch):
    # before: a worker inherited the trainer's whole environment, its tokens and keys included
    monkeypatch.setenv("GCORE_TEST_API_KEY", "planted-secret")  # a gcore prefix, but a key
    monkeypatch.setenv("HF_TOKEN", "planted-secret")  # a library's prefix, but a token
    monkeypatch.setenv("MY_SERVICE_URL", "https://internal.example")  # not on the list
    monkeypatch.setenv("GCORE_WORKER_ENV", "MY_PASSED_TOKEN")  # what the user asks to pass goes
    monkeypatch.setenv("MY_PASSED_TOKEN", "asked-for")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pool = pool_of(Environ())
    try:
        names = ["GCORE_TEST_API_KEY", "HF_TOKEN", "MY_SERVICE_URL", "MY_PASSED_TOKEN", "HF_HUB_OFFLINE", "PATH",
                 "OMP_NUM_THREADS"]
        found = dict(zip(names, score(pool, names), strict=True))
    finally:
        pool.close()
    # 0: absent; 2: present, and in the environment the worker process was started with
    assert found == {"GCORE_TEST_API_KEY": 0.0, "HF_TOKEN": 0.0, "MY_SERVICE_URL": 0.0, "MY_PASSED_TOKEN": 2.0,
                     "HF_HUB_OFFLINE": 2.0, "PATH": 2.0, "OMP_NUM_THREADS": 2.0}, found
    assert os.environ["HF_TOKEN"] == "planted-secret"  # the controller's own environment is untouched
