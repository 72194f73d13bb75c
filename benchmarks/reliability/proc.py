"""Processes for the reliability harness: start a case in a session of its own, watch it, kill its group, and
find what it left behind (through ``/proc``, Linux only)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on


def session_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[3]) if fields else None  # the 6th field: session id


def parent_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def in_session(sid: int) -> list[int]:
    return [p for p in all_pids() if p != os.getpid() and session_of(p) == sid]


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


def leftovers(sid: int, tags: list[str]) -> list[tuple[int, str]]:
    """Processes still alive of session ``sid``, or whose command line names one of ``tags`` or whose working
    directory is under one (a marker path, the case's temp folder: a process that left the session, such as a
    ``setsid`` child or a sandbox's own session)."""
    found = []
    for pid in all_pids():
        if pid == os.getpid():
            continue
        line = cmdline(pid)
        fields = _stat(pid)
        if not fields or fields[0] == "Z":
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        if session_of(pid) == sid or any(tag and (tag in line or cwd.startswith(tag)) for tag in tags):
            found.append((pid, line[:160]))
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def workers_of(sid: int, controller: int) -> list[int]:
    """The engine worker processes of a run: its session's spawned Python processes other than the controller
    and multiprocessing's resource tracker."""
    return sorted(p for p in in_session(sid) if p != controller and "spawn_main" in cmdline(p)
                  and "resource_tracker" not in cmdline(p))


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state held by ``pids``."""
    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != "0A" or cols[9] not in inodes:
                continue
            hexaddr, hexport = cols[1].split(":")
            if width == 8:
                address = ".".join(str(int(hexaddr[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                address = "::1" if hexaddr.endswith("01000000") and set(hexaddr[:24]) == {"0"} else (
                    "::" if set(hexaddr) == {"0"} else hexaddr)
            found.append((inodes[cols[9]], address, int(hexport, 16)))
    return found


@dataclass
class Outcome:
    """How a case's process ended."""

    rc: int | None  # None: killed by the harness (timeout, memory cap, no exit after final/)
    out: str
    err: str
    seconds: float
    killed_for: str = ""  # why the harness killed it
    left: list[tuple[int, str]] = field(default_factory=list)  # processes left behind (then killed)
    notes: list[str] = field(default_factory=list)  # what a probe saw


class Running:
    """One command in a session of its own at ``nice``, stdout/stderr to files under ``log_prefix``."""

    def __init__(self, command: list[str], log_prefix: str, env: dict[str, str] | None = None, nice: int = 10,
                 cwd: str | None = None, stdin: str = "") -> None:
        self.log_prefix = log_prefix
        self.out_path, self.err_path = log_prefix + ".out", log_prefix + ".err"
        self._out, self._err = open(self.out_path, "wb"), open(self.err_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(["nice", "-n", str(nice), *command], stdout=self._out, stderr=self._err,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, env=env, cwd=cwd,
                                     start_new_session=True)
        if stdin and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(stdin.encode())
                self.proc.stdin.close()
            except OSError:  # it exited before reading
                pass
        self.pid = self.proc.pid  # nice execs the command: the same pid, the session leader
        self.notes: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def err_text(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()

    def out_text(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def output_size(self) -> int:
        return os.path.getsize(self.out_path) + os.path.getsize(self.err_path)

    def wait(self, timeout_s: float, max_rss: int = 0, done_path: str = "", exit_grace_s: float = 120.0,
             tick: Callable[[Running], str | None] | None = None, tags: list[str] | None = None) -> Outcome:
        """Wait for the exit; kill the group at ``timeout_s``, when the session's memory passes ``max_rss``,
        when ``done_path`` (a run's ``final/``) exists and the process has not exited ``exit_grace_s`` later, or
        when ``tick`` (called about every 0.5 s) returns a reason."""
        killed_for = ""
        done_seen: float | None = None
        peak = 0
        while self.proc.poll() is None:
            time.sleep(0.5)
            if self.elapsed() > timeout_s:
                killed_for = f"no exit within the harness's {timeout_s:g} s"
            rss = rss_bytes(in_session(self.pid)) if max_rss else 0
            peak = max(peak, rss)
            if max_rss and rss > max_rss:
                killed_for = f"memory of its processes reached {rss / 2**30:.1f} GB (harness cap)"
            if done_path and done_seen is None and glob.glob(done_path, recursive=True):
                done_seen = self.elapsed()
            if done_seen is not None and self.elapsed() - done_seen > exit_grace_s:
                killed_for = (f"{done_path.rsplit('/', 1)[-1]} written at {done_seen:.0f} s, still running "
                              f"{exit_grace_s:g} s later")
            if tick is not None and not killed_for:
                killed_for = tick(self) or ""
            if killed_for:
                kill_group(self.pid, signal.SIGINT)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    kill_group(self.pid)
                    self.proc.wait()
                break
        seconds = self.elapsed()
        self._out.close()
        self._err.close()
        time.sleep(1.0)  # a process the case started without waiting for may take a moment to be seen
        left = leftovers(self.pid, tags or [])
        kill_pids([pid for pid, _ in left])
        if peak:
            self.notes.append(f"peak memory {peak / 2**30:.2f} GB")
        return Outcome(None if killed_for else self.proc.returncode, self.out_text(), self.err_text(), seconds,
                       killed_for, left, self.notes)


def python() -> str:
    return sys.executable
