"""One run per run folder: ``<default_root_dir>/<name>`` is locked while a run writes into it.

The lock is an exclusive ``flock`` on ``<default_root_dir>/.<name>.lock`` (beside the run folder, which
keeps only what the run writes), held by the process that
launched the run for as long as it lives. The kernel releases it when that process ends, however it
ends (SIGKILL and power loss included), so a killed run never leaves a stale lock behind. The file
names the holder (host, pid, start time) for the error a second run gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time

from gcore.errors import ConfigError


class RunLock:
    """Held while a run uses ``folder``; ``acquire`` refuses in one line when another run holds it."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.normpath(folder)
        self.path = os.path.join(os.path.dirname(self.folder) or ".", f".{os.path.basename(self.folder)}.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise a ``ConfigError`` naming the run that holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the processes a run starts
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{self.folder} is in use by another gcore run ({holder}): two runs in one folder would overwrite "
                "each other's metrics and checkpoints; wait for it to end, or pick another --trainer.name or "
                "--trainer.default_root_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd

    def release(self) -> None:
        """Let the next run in (also done by the kernel when this process ends)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "its process did not say which it is"
