"""In a worker actor of a Ray pool (``ray_cluster.py``): the weight versions staged in Ray's object store, and the
named tensors of the latest one (``weights.open_weights`` reads a ``("ray", version, nbytes)`` reference here)."""

from __future__ import annotations

import threading
import warnings

import torch

from gcore.errors import GcoreError

#: how long a worker waits for the weights it is told to load to be staged (they are staged before it is told)
STAGE_WAIT_S = 60.0

_staged: dict[int, list] = {}  # version -> bucket references, in this worker actor's process
_staged_lock = threading.Condition()


def stage(version: int, refs: list) -> None:
    """Keep ``refs`` (a version's buckets) and drop the older versions' (Ray frees a bucket once nothing holds it)."""
    with _staged_lock:
        for old in [v for v in _staged if v < version]:
            del _staged[old]
        _staged[version] = refs
        _staged_lock.notify_all()


def get_weights(ref: tuple) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a staged weight version (``("ray", version, nbytes)``), or of a newer one staged since
    (a worker loads the latest weights)."""
    import ray

    _, version, _ = ref
    with _staged_lock:
        if not _staged_lock.wait_for(lambda: max(_staged, default=-1) >= version, STAGE_WAIT_S):
            raise GcoreError(f"engine worker: weight version {version} was not staged in Ray's object store within "
                             f"{STAGE_WAIT_S:.0f}s (staged: {sorted(_staged)})")
        refs = _staged[max(_staged)]
    named: list[tuple[str, torch.Tensor]] = []
    with warnings.catch_warnings():  # the object store's arrays are read-only; the engine copies from them
        warnings.simplefilter("ignore", UserWarning)
        for bucket in ray.get(refs):
            for name, dtype, shape, flat in bucket:
                named.append((name, torch.from_numpy(flat).view(getattr(torch, dtype)).reshape(shape)))
    return named
