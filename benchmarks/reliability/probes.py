"""Probes of the engine worker pool: each starts a ``gcore fit`` run with ``--placement.workers 2`` and acts on
it as the review's poolprobe.py did. A probe returns the run's :class:`~proc.Outcome` (its ``notes`` say what the
probe saw and did) and, for ``addresses_and_weights``, verdicts of its own for the two cases it serves.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import stat
import struct
import time
from collections.abc import Callable

from proc import Outcome, Running, listening, workers_of

Start = Callable[[list[str], str], Running]  # (extra fit options, log name) -> a started run


def _metrics_rows(root: str) -> int:
    rows = 0
    for path in glob.glob(os.path.join(root, "**", "metrics.csv"), recursive=True):
        with open(path) as f:
            rows = max(rows, sum(1 for _ in f) - 1)
    return rows


def addresses_and_weights(start: Start, root: str, timeout_s: float) -> tuple[Outcome, dict[str, tuple[str, str]]]:
    """A 6-step run; every 0.2 s: the listening sockets of its processes, and the ``/dev/shm/gcore-weights-*``
    files named for one of its pids, with their modes."""
    run = start(["--placement.workers", "2", "--trainer.max_steps", "6"], "pool.addresses_and_weights")
    addresses: set[str] = set()
    modes: dict[str, int] = {}

    def tick(r: Running) -> None:
        from proc import in_session

        pids = [r.pid, *in_session(r.pid)]
        for _, address, port in listening(pids):
            addresses.add(f"{address}:{port}")
        for path in glob.glob("/dev/shm/gcore-weights-*"):
            owner = os.path.basename(path).split("-")[2]
            if owner.isdigit() and int(owner) in pids:
                try:
                    modes[os.path.basename(path)] = stat.S_IMODE(os.stat(path).st_mode)
                except OSError:
                    pass
        return None

    outcome = run.wait(timeout_s, tick=tick)
    loopback = all(a.startswith(("127.", "::1")) for a in addresses)
    outcome.notes.append(f"listening: {sorted(addresses) or 'none seen'}")
    outcome.notes.append("weight files: " + (", ".join(f"{n} {m:o}" for n, m in sorted(modes.items()))
                                              or "none seen"))
    verdicts: dict[str, tuple[str, str]] = {}
    if not addresses:
        verdicts["pool.addresses"] = ("unclear", "no listening socket seen (the run ended too fast to sample?)")
    else:
        verdicts["pool.addresses"] = ("ok" if loopback else "unsafe", f"listening: {', '.join(sorted(addresses))}")
    readable = {n: m for n, m in modes.items() if m & 0o077}
    if readable:
        verdicts["pool.weights_mode"] = ("unsafe", "readable by others: " + ", ".join(
            f"{n} mode {m:o}" for n, m in sorted(readable.items())))
    elif modes:
        verdicts["pool.weights_mode"] = ("ok", ", ".join(f"{n} mode {m:o}" for n, m in sorted(modes.items())))
    else:
        verdicts["pool.weights_mode"] = ("ok", "no gcore-weights-* file of the run seen in /dev/shm")
    return outcome, verdicts


def _first_listener(run: Running, deadline_s: float) -> tuple[int, int] | None:
    """(worker pid, port) of the first worker seen listening, polled every 20 ms."""
    while run.proc.poll() is None and run.elapsed() < deadline_s:
        for pid, _, port in listening(workers_of(run.pid, run.pid)):
            return pid, port
        time.sleep(0.02)
    return None


def _stalled(stall_s: float, root: str) -> Callable[[Running], str | None]:
    """A ``tick`` that stops a run whose output and ``metrics.csv`` have not grown for ``stall_s`` seconds."""
    last = {"size": -1, "at": time.monotonic()}

    def tick(run: Running) -> str | None:
        size = run.output_size() + 10**9 * _metrics_rows(root)
        if size != last["size"]:
            last["size"], last["at"] = size, time.monotonic()
        elif time.monotonic() - last["at"] > stall_s:
            return f"no output and no new metrics row for {stall_s:g} s (stalled)"
        return None

    return tick


def silent_client(start: Start, root: str, timeout_s: float, stall_s: float = 180.0) -> Outcome:
    """Connect to a worker's port before the controller does and stay silent; SIGKILL the other worker 7 s later;
    the run must report or go on, not wait for ever."""
    run = start(["--placement.workers", "2", "--trainer.max_steps", "30"], "pool.silent_client")
    found = _first_listener(run, timeout_s / 2)
    held = None
    if found is None:
        run.notes.append("no worker was seen listening")
    else:
        pid, port = found
        held = socket.create_connection(("127.0.0.1", port), timeout=5)
        run.notes.append(f"connected to worker pid {pid} port {port} at {run.elapsed():.1f} s, silent")
        time.sleep(7)
        others = [w for w in workers_of(run.pid, run.pid) if w != pid]
        if others:
            os.kill(others[0], signal.SIGKILL)
            run.notes.append(f"SIGKILLed worker pid {others[0]} at {run.elapsed():.1f} s")
    try:
        return run.wait(timeout_s, tick=_stalled(stall_s, root))
    finally:
        if held is not None:
            held.close()


def garbage_client(start: Start, root: str, timeout_s: float, stall_s: float = 180.0) -> Outcome:
    """Connect to a worker's port, read its challenge, answer with a wrong digest; the run must go on."""
    run = start(["--placement.workers", "2", "--trainer.max_steps", "4"], "pool.garbage_client")
    found = _first_listener(run, timeout_s / 2)
    if found is None:
        run.notes.append("no worker was seen listening")
    else:
        pid, port = found
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                challenge = s.recv(4096)
                s.sendall(struct.pack("!i", 8) + b"garbage!")
                reply = s.recv(4096)
            run.notes.append(f"sent a wrong digest to worker pid {pid} port {port} at {run.elapsed():.1f} s "
                             f"(challenge {challenge[:16]!r}..., reply {reply[:24]!r})")
        except OSError as err:
            run.notes.append(f"worker pid {pid} port {port}: {type(err).__name__}: {err}")
    return run.wait(timeout_s, tick=_stalled(stall_s, root))


def kill_running(start: Start, root: str, timeout_s: float) -> Outcome:
    """SIGKILL one of 2 workers once 2 steps are logged; the run should finish its 6 steps."""
    run = start(["--placement.workers", "2", "--trainer.max_steps", "6"], "pool.kill_running")
    killed = False

    def tick(r: Running) -> None:
        nonlocal killed
        if not killed and _metrics_rows(root) >= 2:
            workers = workers_of(r.pid, r.pid)
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                killed = True
                r.notes.append(f"SIGKILLed worker pid {workers[0]} at {r.elapsed():.1f} s ({_metrics_rows(root)} "
                               "steps logged)")
        return None

    outcome = run.wait(timeout_s, tick=tick)
    if not killed:
        outcome.notes.append("no worker was killed (the run ended before 2 steps were logged)")
    return outcome


def kill_loading(start: Start, root: str, timeout_s: float) -> Outcome:
    """SIGKILL an engine worker 3 s after it appears (while it imports and loads); a one-line error or a
    recovery, not a hang."""
    run = start(["--placement.workers", "2", "--trainer.max_steps", "2"], "pool.kill_loading")
    while run.proc.poll() is None and run.elapsed() < timeout_s / 2:
        workers = workers_of(run.pid, run.pid)
        if workers:
            time.sleep(3)
            try:
                os.kill(workers[0], signal.SIGKILL)
                run.notes.append(f"SIGKILLed worker pid {workers[0]} at {run.elapsed():.1f} s (while loading)")
            except OSError:
                run.notes.append("the worker was gone before the kill")
            break
        time.sleep(0.1)
    return run.wait(timeout_s, tick=_stalled(300.0, root))
