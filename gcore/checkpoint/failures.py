"""Why a save or a load failed, in one line: the innermost error of DCP's per-rank ``CheckpointException``, and
for a full disk the space the write needed and the space that was free."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator

import torch

from gcore.checkpoint.files import CheckpointError


def tree_bytes(obj: object) -> int:
    """The bytes of the tensors in a nested state (what a save of it writes, roughly); a sharded
    tensor (DTensor) counts with its whole size, as all ranks together write it."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tree_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_bytes(v) for v in obj)
    return 0


def causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, its causes and contexts, and the per-rank errors inside a DCP ``CheckpointException``."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]


def failures() -> tuple[type[BaseException], ...]:
    """What a failed save or load raises: DCP's ``CheckpointException`` is a ``BaseException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def root_error(err: BaseException) -> BaseException:
    """The innermost error worth naming (DCP wraps every rank's error in a ``CheckpointException``)."""
    for e in causes(err):
        if isinstance(e, CheckpointError):
            return e
    inner = [e for e in causes(err) if e is not err and type(e).__name__ != "CheckpointException"]
    return inner[-1] if inner else err


def _free_bytes(path: str) -> int:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path or ".").free


def _is_disk_full(err: BaseException, free: int, needed: int) -> bool:
    for e in causes(err):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(e) or "os error 28" in str(e):
            return True
    return free < needed  # torch's writer reports a full disk as "unexpected pos ..."


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def disk_error(what: str, where: str, err: BaseException, needed: int) -> str | None:
    """One line for a write that failed on a full disk, or ``None`` when it was something else."""
    free = _free_bytes(where)
    if not _is_disk_full(err, free, needed):
        return None
    return f"{where}: disk full while writing {what} (needs about {_mb(needed)}, {_mb(free)} free)"
