"""Which controller was lost: heartbeats, child-process exit codes and the rendezvous store.

When one controller dies (SIGKILL, out of memory, a machine gone), the others learn it only as a
broken collective ("Connection reset by peer"), which names no rank, or not at all while they are
busy generating. ``ControllerWatch`` runs a thread in every controller that

- bumps this controller's heartbeat counter in the run's rendezvous store (``MASTER_ADDR:MASTER_PORT``)
  and watches the others' counters;
- on the process that launched the local controllers, polls their exit codes (a controller killed
  by a signal is named with the signal at once);
- treats the store itself going away as the loss of controller 0, which hosts it.

Heartbeats come from that thread, not from the training loop, so a controller that is busy (a long
generation, a save) still beats; one that stops beating for ``--trainer.heartbeat_timeout`` seconds
(30 by default, far below the collective timeout) is frozen (SIGSTOP, a debugger, a hung driver) or
gone. Each controller records its host and pid in the store, so a frozen controller on the same
machine is ended (SIGKILL) by the controller that found it: no process of the run stays behind.

A controller that is lost is reported once, naming it and the reason; if this controller is still
running ``grace`` seconds later (busy, or blocked in a collective that would only fail after
``--trainer.collective_timeout``), the watch ends the process and its local controllers, so that
no rank waits forever. A controller that fails with its own error, or finishes, says so in the
store first (``mark``), so it is not mistaken for a lost one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import FrameType
from typing import NoReturn

from gcore.errors import GcoreError, Interrupted

PREFIX = "gcore/watch"
EXIT_LOST = 3  # exit status of a controller stopped because another one was lost


def describe_exit(code: int) -> str:
    """``-9`` -> ``killed by SIGKILL``; ``2`` -> ``exited with status 2``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class ControllerWatch:
    """Names lost controllers and stops this one when a peer is gone; one per controller process.

    Args:
        rank, world_size: this controller's place in the run.
        store: a ``torch.distributed.Store`` client of its own (not shared with other threads), or
            ``None`` to watch only the local child processes.
        children: global rank -> ``subprocess.Popen`` of the controllers this process launched.
        silence_limit: seconds without a heartbeat after which a controller is declared lost.
        interval: seconds between heartbeats and checks.
        grace: seconds this controller may go on after a loss before the watch ends it.
    """

    def __init__(self, rank: int, world_size: int, store=None,  # noqa: ANN001
                 children: dict[int, subprocess.Popen] | None = None, silence_limit: float = 30.0,
                 interval: float = 0.5, grace: float = 15.0) -> None:
        self.rank, self.world_size = rank, world_size
        self.store = store
        self.children = dict(children or {})
        self.silence_limit, self.interval, self.grace = silence_limit, interval, grace
        self.lost: dict[int, str] = {}
        self._found = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last changed)
        self._where: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), as each controller recorded it
        self._thread = threading.Thread(target=self._run, name="gcore-controller-watch", daemon=True)
        # the store's calls have no timeout of their own: one to a frozen controller 0 blocks forever, so
        # they run in a thread apart, and the watch thread judges from when they last answered
        self._store_thread = threading.Thread(target=self._run_store, name="gcore-controller-heartbeat", daemon=True)
        self._store_ok_at = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    def for_fabric(cls, fabric, silence_limit: float) -> ControllerWatch:  # noqa: ANN001
        """A started watch for this Fabric run: its own store client, and the launched children."""
        store = _connect_store(timeout=max(5.0, min(silence_limit, 30.0)))
        children = {}
        procs = list(getattr(fabric.strategy.launcher, "procs", None) or [])
        if procs:  # this process launched controllers 1..len(procs) of its node (Lightning's subprocess launcher)
            per_node = len(procs) + 1
            children = {fabric.node_rank * per_node + i + 1: proc for i, proc in enumerate(procs)}
            _retire_lightning_observer()  # it would SIGKILL this process 5 s after a child's death, silently
        watch = cls(fabric.global_rank, fabric.world_size, store, children, silence_limit)
        watch.start()
        return watch

    def start(self) -> None:
        """Record where this controller runs, learn where the others do, and start beating.

        Every controller starts its watch right after the launch, before the first collective, and
        waits here (at most ``silence_limit`` s) for the others' records: one frozen early, with the
        store it hosts, could not be looked up later, nor ended."""
        if self.store is not None:
            try:
                with self._store_lock:
                    self.store.set(f"{PREFIX}/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
                    peers = [f"{PREFIX}/pid/{peer}" for peer in range(self.world_size) if peer != self.rank]
                    self.store.wait(peers, timedelta(seconds=self.silence_limit))
                    self._read_where()
            except Exception:  # noqa: BLE001  a peer that never recorded itself is found silent by the beats
                pass
            self._beat()
            self._store_ok_at = time.monotonic()
            self._store_thread.start()
        self._thread.start()

    def stop(self) -> None:
        """Say this controller finished and stop watching (before the run's last barrier)."""
        self.mark("done")
        self._stop.set()
        for thread in (self._thread, self._store_thread):
            if thread.is_alive():
                thread.join(timeout=5 * self.interval + 5)

    def mark(self, state: str) -> None:
        """Record ``done`` or ``failed: <why>`` for the other controllers' watches."""
        if self.store is None or 0 in self.lost:  # no store left to tell
            return
        try:
            with self._store_lock:
                self.store.set(f"{PREFIX}/state/{self.rank}", state)
        except Exception:  # noqa: BLE001  the store may be gone with controller 0; nothing to tell then
            pass

    # -- queries ---------------------------------------------------------------------------

    def wait_for_loss(self, timeout: float) -> dict[int, str]:
        """Lost controllers (rank -> reason), waiting up to ``timeout`` s for the watch to find one."""
        self._found.wait(timeout)
        with self._lock:
            return dict(self.lost)

    def describe(self, lost: dict[int, str] | None = None) -> str:
        lost = self.lost if lost is None else lost
        return "; ".join(f"controller {r} {why}" for r, why in sorted(lost.items()))

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        acted_at = None
        while not self._stop.wait(self.interval):
            self._check_children()
            silent = time.monotonic() - self._store_ok_at
            if self.store is not None and self.rank != 0 and 0 not in self.lost and silent > self.silence_limit:
                self._lose(0, f"is frozen or gone: the rendezvous store it hosts has not answered for "
                              f"{self.silence_limit:g} s{self._end_peer(0)}")
            if self.lost and acted_at is None:
                acted_at = time.monotonic()
                print(f"gcore: controller {self.rank}: {self.describe()}; stopping the run "
                      "(continue it with --trainer.resume auto)", file=sys.stderr, flush=True)
            if acted_at is not None and time.monotonic() - acted_at > self.grace:
                self._end_process()

    def _run_store(self) -> None:
        """Heartbeats and the peers' counters (every store call is made here)."""
        while not self._stop.wait(self.interval) and 0 not in self.lost:
            if self._beat():
                self._store_ok_at = time.monotonic()
                self._check_peers()

    def _lose(self, rank: int, reason: str) -> None:
        with self._lock:
            self.lost.setdefault(rank, reason)
        self._found.set()

    def _check_children(self) -> None:
        for rank, proc in self.children.items():
            code = proc.poll()
            if code is not None and code != 0 and rank not in self.lost:
                state = self._state_of(rank)
                if state.startswith("failed: "):  # it said why before it ended (a signal may still end it)
                    self._lose(rank, f"failed ({state[len('failed: '):]}; then {describe_exit(code)}, pid {proc.pid})")
                elif code < 0:
                    self._lose(rank, f"was {describe_exit(code)} (pid {proc.pid})")
                else:
                    self._lose(rank, f"failed ({describe_exit(code)}, pid {proc.pid}; its error is above)")

    def _state_of(self, rank: int) -> str:
        """What a controller last recorded (``done``, ``failed: <why>``), or "" when unknown."""
        if self.store is None or 0 in self.lost:
            return ""
        try:
            with self._store_lock:
                key = f"{PREFIX}/state/{rank}"
                return self.store.get(key).decode() if self.store.check([key]) else ""
        except Exception:  # noqa: BLE001  the store may be gone; the exit status is then all there is
            return ""

    def _beat(self) -> bool:
        try:
            with self._store_lock:
                self.store.add(f"{PREFIX}/beat/{self.rank}", 1)
            return True
        except Exception as err:  # noqa: BLE001  controller 0 hosts the store: only the others can lose it
            if self.rank != 0 and 0 not in self.lost:
                # it died, or it is frozen and its store with it: a frozen one is ended here
                self._lose(0, f"is gone: the rendezvous store it hosts stopped answering ({_first_line(err)})"
                              f"{self._end_peer(0)}")
            return False

    def _check_peers(self) -> None:
        now = time.monotonic()
        for peer in range(self.world_size):
            if peer == self.rank or peer in self.lost:
                continue
            try:
                with self._store_lock:
                    count = self.store.add(f"{PREFIX}/beat/{peer}", 0)
                    state_key = f"{PREFIX}/state/{peer}"
                    state = self.store.get(state_key).decode() if self.store.check([state_key]) else ""
                    if peer not in self._where:
                        self._read_where()
            except Exception:  # noqa: BLE001  reported by _beat as the loss of controller 0
                return
            if state == "done":
                continue
            last = self._seen.get(peer)
            if last is None or last[0] != count:
                self._seen[peer] = (count, now)
            elif now - last[1] > self.silence_limit:
                if state.startswith("failed"):
                    self._lose(peer, f"failed ({state[len('failed: '):]})")
                else:
                    self._lose(peer, f"sent no heartbeat for {self.silence_limit:g} s (frozen, killed, or its "
                                     f"machine is gone){self._end_peer(peer)}")

    def _read_where(self) -> None:
        """The host and pid of every peer that has recorded them (call with ``_store_lock`` held)."""
        for peer in range(self.world_size):
            key = f"{PREFIX}/pid/{peer}"
            if peer != self.rank and peer not in self._where and self.store.check([key]):
                host, pid = self.store.get(key).decode().rsplit(" ", 1)
                self._where[peer] = (host, int(pid))

    def _end_peer(self, peer: int) -> str:
        """SIGKILL a silent controller on this machine (a frozen one would hold its resources forever);
        returns what was done, for the loss message."""
        if peer not in self._where or self._where[peer][1] == os.getpid():  # (one process in tests)
            return ""
        host, pid = self._where[peer]
        if host != socket.gethostname():
            return f"; it runs on {host} as pid {pid}: end it there"
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return ""  # it already exited
        except OSError as err:
            return f"; could not end its process {pid}: {err}"
        return f"; its process {pid} was ended"

    def _end_process(self) -> None:
        print(f"gcore: controller {self.rank}: still running {self.grace:.0f} s after the loss ({self.describe()}); "
              "ending it", file=sys.stderr, flush=True)
        for proc in self.children.values():
            if proc.poll() is None:
                proc.kill()  # a controller blocked in a collective does not answer SIGTERM
        os._exit(EXIT_LOST)


def report_rank_failure(rank: int, err: Exception, watch: ControllerWatch | None = None) -> NoReturn:
    """Say which controller failed and why, and raise.

    An error of the types a broken collective raises (``RuntimeError``, which gloo and DDP's
    gradient hooks raise for a peer gone, ``torch.distributed``'s own errors, connection and
    timeout errors) first asks the watch whether another controller was lost; if one was, the error
    names it. Other errors are this controller's own."""
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, (RuntimeError, ConnectionError, TimeoutError)) and not isinstance(err, GcoreError):
        found = watch.wait_for_loss(timeout=10.0) if watch is not None else {}
        if watch is not None and found:
            watch.mark(f"failed: lost contact ({message})")
            raise GcoreError(
                f"controller {rank}: {watch.describe(found)}; the run stopped at the broken collective "
                f"({message}). Continue it from the last complete checkpoint with --trainer.resume auto"
            ) from err
        if from_collective(err):
            if watch is not None:
                watch.mark(f"failed: lost contact ({message})")
            raise GcoreError(
                f"controller {rank}: lost contact with another controller ({message}); that controller's own "
                "error is reported above"
            ) from err
    if watch is not None:
        watch.mark(f"failed: {type(err).__name__}: {message}")
    print(f"gcore: controller {rank} failed: {type(err).__name__}: {message}", file=sys.stderr, flush=True)
    raise err


def from_collective(err: BaseException) -> bool:
    """Whether ``err`` came out of ``torch.distributed``: one of its error types, a connection or
    timeout error, or an error raised inside it (gloo reports a peer gone as a plain
    ``RuntimeError`` from the collective)."""
    import torch.distributed as dist

    if isinstance(err, (dist.DistError, ConnectionError, TimeoutError)):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("torch.distributed")


class Signals:
    """SIGINT and SIGTERM raise ``Interrupted`` (a ``KeyboardInterrupt``) in the main thread, so that a run
    finishes its save in flight and says where to continue; ``deferred()`` holds one signal back
    while a save is being started (a second one goes through at once)."""

    def __init__(self) -> None:
        self._deferring = False
        self._held: int | None = None

    def install(self) -> Callable[[], object]:
        """Take over both signals; returns the function that gives them back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring and self._held is None:
            self._held = signum
            return
        self._raise(signum)

    @staticmethod
    def _raise(signum: int) -> None:
        # ``Interrupted`` for both: a signal held by ``deferred`` is raised outside the handler, and must
        # still read as a signal (``user_code.from_signal``), not as a plugin's own ``KeyboardInterrupt``
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold one SIGINT or SIGTERM until the block ends, then raise it."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            held, self._held = self._held, None
            if held is not None:
                self._raise(held)


SIGNALS = Signals()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _connect_store(timeout: float):  # noqa: ANN202
    """A client of the run's rendezvous store of our own (``None`` when there is none to reach)."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    except Exception as err:  # noqa: BLE001  the run works without heartbeats; only the loss messages are poorer
        print(f"gcore: controller heartbeats disabled: cannot reach the store at {host}:{port} ({_first_line(err)})",
              file=sys.stderr, flush=True)
        return None


def _retire_lightning_observer() -> None:
    """Lightning's child-process observer SIGKILLs the launcher 5 s after any child exits non-zero,
    before gcore can say which controller was lost; ``ControllerWatch`` does that job instead."""
    for thread in threading.enumerate():
        if thread.name == "child-process-observer" and hasattr(thread, "_child_processes"):
            thread._child_processes = []  # its next check sees nothing left to watch and ends
