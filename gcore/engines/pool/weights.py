"""The policy weights' hand-off from the owner controller to the workers: one file in ``/dev/shm`` (a pool on
one machine), or Ray's object store (a pool on a Ray cluster: ``ray_cluster.put_weights``).

The owner copies its tensors into the file once per step (one region per parameter, 64-byte aligned); every
worker that holds the policy maps the file and copies from it into its engine (``SharedWeights.views``).

Who can read it: the file is created with ``os.open(O_CREAT | O_EXCL, 0o600)`` under a name with 16 random
bytes, so only the user who runs gcore can open it (it was ``-rw-r--r--``, readable by every local user, while a
run lived), and a file planted under that name beforehand is refused rather than reused. It is a named file, not
an anonymous ``memfd``, because a worker respawned later, or one that wakes the policy again, maps it by its path.

When it goes: ``remove`` is called by ``WorkerPool.close`` first (before the workers are joined, so a close cut
short by a second Ctrl-C still removes it), and an ``atexit`` hook removes every file this process created and
has not removed yet: the file goes on a normal exit, an exception that ends the program and a Ctrl-C, whether or
not the pool was closed. A SIGKILL of the owner leaves it (no code runs then); its name says whose it was
(``gcore-weights-<pid>-...``).
"""

from __future__ import annotations

import atexit
import os
import secrets
from dataclasses import dataclass

import torch

from gcore.errors import GcoreError

ROOT = "/dev/shm"
#: the mode of a weight file: the user who runs gcore alone reads and writes it
MODE = 0o600

_created: set[str] = set()  # the files of this process not removed yet (``_remove_all`` at exit)


@dataclass
class SharedWeights:
    """Policy weights in one shared-memory file: ``layout`` is (name, dtype, shape, byte offset)."""

    path: str
    nbytes: int
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]
    version: int = 0

    def views(self) -> list[tuple[str, torch.Tensor]]:
        storage = torch.UntypedStorage.from_file(self.path, shared=True, nbytes=self.nbytes)
        out = []
        for name, dtype, shape, offset in self.layout:
            item = torch.empty((), dtype=dtype).element_size()
            # torch's stub lists set_(storage, offset, size) only with a stride; without one torch takes the
            # contiguous strides
            view = torch.empty(0, dtype=dtype).set_(storage, offset // item, shape)  # type: ignore[call-overload]
            out.append((name, view))
        return out

    def ref(self) -> tuple[str, int, list, int]:
        return (self.path, self.nbytes, self.layout, self.version)


def create_shared(named: list[tuple[str, torch.Tensor]]) -> SharedWeights:
    """A new, zeroed weight file sized for ``named``, mode 0600, removed at this process's exit at the latest."""
    layout, offset = [], 0
    for name, tensor in named:
        offset = (offset + 63) // 64 * 64
        layout.append((name, tensor.dtype, tuple(tensor.shape), offset))
        offset += tensor.numel() * tensor.element_size()
    if not os.path.isdir(ROOT):
        raise GcoreError(f"weight sync to engine workers needs {ROOT} (shared memory) on this machine")
    path = os.path.join(ROOT, f"gcore-weights-{os.getpid()}-{secrets.token_hex(16)}")
    nbytes = max(offset, 1)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, MODE)
    try:
        _created.add(path)
        os.fchmod(fd, MODE)  # the umask can only take bits away; this says the mode whatever it is
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        remove(path)
        raise
    os.close(fd)
    return SharedWeights(path, nbytes, layout)


def open_weights(ref: tuple) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a weight hand-off, in a worker: ``ref`` is a ``SharedWeights.ref()`` (a file in
    ``/dev/shm``) or a ``RayWorkers.put_weights`` reference (``("ray", ...)``: buckets in Ray's object store,
    ``ray_weights.py``)."""
    if ref and ref[0] == "ray":
        from gcore.engines.pool.ray_weights import get_weights

        return get_weights(ref)
    return SharedWeights(*ref).views()


def remove(path: str) -> None:
    """Remove a weight file of this process (nothing when it is gone already)."""
    _created.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _remove_all() -> None:
    for path in list(_created):
        remove(path)
