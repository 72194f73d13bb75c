"""Where an environment's ``reset`` and ``step`` run (``--env.isolation``, docs/agents.md).

``process`` (the default): in child processes of the controller, one call at a time each, as many as
``--env.workers``. The environment object (after ``setup``) is pickled to each child once; an episode's
state travels with each call (the child returns it with the ``Turn``), so any child can run any episode's
next turn. A call that overruns ``--env.timeout_s`` has its child killed (SIGKILL): nothing of it is left
running, and the next call starts a fresh child. A child that dies (a crash, ``os._exit``) ends only the
episode whose call it ran. The children are started from a ``forkserver`` (a clean process that imports
gcore and the environment's module once), ignore Ctrl-C (the controller decides), and are killed when the
environment's runner is closed, when the controller exits, or when the process that started them dies.

``thread``: in daemon threads of the controller, as before: no pickling, the environment shares the
controller's objects; a call past its timeout is abandoned but cannot be killed (it is left running, and
no longer holds the process's exit).

Both run the calls on ``workers`` daemon threads of the controller (``CallPool``); with ``process`` such a
thread only waits on its child's pipe, with a deadline.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from gcore.environ import children_import_this_gcore
from gcore.errors import ConfigError, GcoreError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from gcore.envs.base import Environment

log = logging.getLogger(__name__)

#: seconds a closing runner waits for an idle child to leave on its own before killing it
_CLOSE_GRACE_S = 1.0
_START_TIMEOUT_S = 300.0  # a child's start: the forkserver's first use and the environment's unpickling
_READY = b"ready"


class CallTimeout(Exception):
    """An environment call that did not return within its timeout (its child process was killed)."""


class CallFailed(Exception):
    """An environment call that raised, or whose child process died; the message says which."""


class CallPool:
    """``workers`` daemon threads that run submitted calls (a ``ThreadPoolExecutor`` whose threads do not hold
    the interpreter's exit: a timed-out ``step`` left in a thread does not keep a finished run alive)."""

    def __init__(self, workers: int, name: str = "gcore-env") -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:  # noqa: ANN401  any call
        future: Future[Any] = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001  handed to the waiter, whatever it is
                future.set_exception(err)

    def shutdown(self) -> None:
        """Cancel the calls not started; the threads end after their current call (nobody waits for them)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)


def run_call(env: Environment, method: str, args: tuple[Any, ...]) -> Any:  # noqa: ANN401  what the call returns
    """``env.reset(prompt)`` or ``env.step(state, text)`` here (awaiting an ``async def`` one); a ``step``
    returns ``(turn, state)``, a ``reset`` its state."""
    result = getattr(env, method)(*args)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return (result, args[0]) if method == "step" else result


async def _await(awaitable: Any) -> Any:  # noqa: ANN401  whatever the environment's coroutine returns
    return await awaitable


class ProcessRunner:
    """Child processes that run an environment's calls (``--env.isolation process``); thread-safe."""

    def __init__(self, env: Environment) -> None:
        import multiprocessing

        self.name = f"{type(env).__module__}.{type(env).__name__}"
        try:
            self._payload = pickle.dumps(env, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001  any pickling failure, named in one line
            raise ConfigError(f"--env {self.name}: cannot be sent to its own process (--env.isolation process): "
                              f"{type(err).__name__}: {err}; make it picklable, or pass --env.isolation thread "
                              "(a step past --env.timeout_s then cannot be killed)") from None
        self._ctx = multiprocessing.get_context("forkserver")
        _preload(self._ctx, type(env).__module__)
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # children started (a killed one is replaced by a new one)
        self.killed = 0  # children killed at a timeout
        _RUNNERS.add(self)

    def call(self, method: str, args: tuple[Any, ...], timeout: float) -> Any:  # noqa: ANN401  the call's result
        """Run ``env.<method>(*args)`` in a child; raises ``CallTimeout`` (the child killed), ``CallFailed`` (it
        raised, or its child died) or the ``GcoreError`` it raised (a one-line error of the run)."""
        child = self._take()
        deadline = time.monotonic() + timeout
        try:
            child.conn.send_bytes(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, EOFError) as err:
            self._discard(child)
            raise CallFailed(f"its process ended before the call ({child.ended(err)})") from None
        except Exception as err:  # noqa: BLE001  a state or prompt that cannot be pickled
            self._give_back(child)
            raise ConfigError(f"--env {self.name}: the {method} call cannot be sent to the environment's process "
                              f"(--env.isolation process): {type(err).__name__}: {err}; make the episode state "
                              "picklable, or pass --env.isolation thread") from None
        try:
            ready = child.conn.poll(max(deadline - time.monotonic(), 0.0))
            if not ready:
                self._kill(child)
                raise CallTimeout(f"its process (pid {child.process.pid}) was killed")
            reply = child.conn.recv_bytes()
        except (OSError, EOFError) as err:
            self._discard(child)
            raise CallFailed(f"its process ended ({child.ended(err)})") from None
        self._give_back(child)
        status, value = pickle.loads(reply)  # the environment's own code answers (the plugin the run loaded)
        if status == "ok":
            return value
        if status == "gcore":  # a GcoreError of the environment's (a bad prompt, an option): the run's error
            kind, message = value
            raise _gcore_error(kind)(message)
        raise CallFailed(value)

    def close(self) -> None:
        """Stop every child: idle ones are asked to leave, then whatever is left is killed."""
        with self._lock:
            self._closed = True
            children, self._idle = list(self._all), []
            self._all.clear()
        for child in children:
            try:
                child.conn.send_bytes(b"")  # an empty message: leave
            except (OSError, EOFError):
                pass
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for child in children:
            child.process.join(max(deadline - time.monotonic(), 0.0))
            if child.process.is_alive():
                child.process.kill()
                child.process.join(5.0)
            child.conn.close()
        _RUNNERS.discard(self)

    def children(self) -> list[int]:
        """The pids of the children alive now (for tests and diagnostics)."""
        with self._lock:
            return [c.process.pid for c in self._all if c.process.pid is not None]

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise CallFailed("the environment's processes were closed")
            while self._idle:
                child = self._idle.pop()
                if child.process.is_alive():
                    return child
                self._all.discard(child)
        child = self._start()
        with self._lock:
            self._all.add(child)
        return child

    def _start(self) -> _Child:
        parent, there = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_child_main, args=(there, self._payload), daemon=True,
                                    name=f"gcore-env-{self.name}")
        with children_import_this_gcore():  # the forkserver, started on first use, imports from the path set here
            process.start()
        there.close()
        self.started += 1
        child = _Child(process, parent)
        # a call's --env.timeout_s starts once the child has built the environment: its start (the forkserver's first
        # use, unpickling the environment, importing its module) is not the environment's call, and takes seconds on
        # a busy machine
        try:
            if not parent.poll(_START_TIMEOUT_S):
                self._kill(child)
                raise CallFailed(f"its process (pid {process.pid}) did not start within {_START_TIMEOUT_S:.0f} s")
            parent.recv_bytes()  # ``_READY``
        except (OSError, EOFError) as err:
            self._discard(child)
            raise CallFailed(f"its process ended while it started ({child.ended(err)})") from None
        return child

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if self._closed:
                child.process.kill()
                return
            self._idle.append(child)

    def _discard(self, child: _Child) -> None:
        with self._lock:
            self._all.discard(child)
        if child.process.is_alive():
            child.process.kill()
        child.process.join(5.0)
        child.conn.close()

    def _kill(self, child: _Child) -> None:
        self.killed += 1
        self._discard(child)


class _Child:
    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process, self.conn = process, conn

    def ended(self, err: BaseException) -> str:
        self.process.join(2.0)
        code = self.process.exitcode
        if code is None:
            return f"{type(err).__name__}"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"


def _gcore_error(kind: str) -> type[GcoreError]:
    import gcore.errors

    found = getattr(gcore.errors, kind, None)
    return found if isinstance(found, type) and issubclass(found, GcoreError) else GcoreError


_PRELOADED: list[str] = []


def _preload(ctx: Any, module: str) -> None:  # noqa: ANN401  a forkserver context
    """The forkserver imports gcore's environments (and the first environment's module) once; its children start
    from that. Only before the server is started (it is one per process)."""
    wanted = ["gcore.envs.isolation", *([module] if module not in ("__main__", "__mp_main__") else [])]
    if not _PRELOADED:
        _PRELOADED.extend(wanted)
        ctx.set_forkserver_preload(wanted)


def _child_main(conn: Connection, payload: bytes) -> None:
    """A child's loop: build the environment from the controller's pickle, then answer calls until told to leave
    (an empty message) or the controller's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the controller decides
    _die_with_parent()
    env = pickle.loads(payload)  # the controller's own pickle of the environment it built
    conn.send_bytes(_READY)  # built: the controller starts the call's timeout now
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not message:
            return
        method, args = pickle.loads(message)  # from the controller
        try:
            reply: tuple[str, Any] = ("ok", run_call(env, method, args))
        except GcoreError as err:
            reply = ("gcore", (type(err).__name__, str(err)))
        except BaseException as err:  # noqa: BLE001  SystemExit, KeyboardInterrupt of its own: the episode's error
            text = str(err)
            reply = ("error", f"{type(err).__name__}: {text}" if text else type(err).__name__)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001  a Turn or state that cannot be pickled
            data = pickle.dumps(("error", f"its result cannot be sent back to the controller ({type(err).__name__}: "
                                          f"{err}): keep Turn and episode state picklable, or pass --env.isolation "
                                          "thread"))
        conn.send_bytes(data)


def _die_with_parent() -> None:
    """SIGKILL this child when the process that started it (the forkserver, which ends with the controller)
    dies (Linux ``PR_SET_PDEATHSIG``); elsewhere the closed pipe ends an idle child."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)
    except (OSError, AttributeError):
        pass


#: the runners alive, closed at exit (their children killed) even when nobody closed them
_RUNNERS: weakref.WeakSet[ProcessRunner] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit: every runner's children killed, then the forkserver stopped and waited for (it would leave on its
    own once this process is gone, a moment later: a finished run leaves no process behind)."""
    for runner in list(_RUNNERS):
        try:
            runner.close()
        except Exception:  # noqa: BLE001  at exit: the children die with the forkserver anyway
            pass
    if _PRELOADED:  # a forkserver was started for environments
        try:
            from multiprocessing import forkserver

            forkserver._forkserver._stop()  # type: ignore[attr-defined]  # CPython's own (for its tests)
        except Exception:  # noqa: BLE001  another Python's forkserver: it leaves with this process
            pass
