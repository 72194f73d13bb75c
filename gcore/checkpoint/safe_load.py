"""Reading a checkpoint without running code from it: DCP's ``.metadata`` through an unpickler that accepts only
DCP's metadata classes, DCP's non-tensor items and the ``rank_<r>.pt`` files with ``weights_only=True``; and the
random-number generators' state that those files carry, for an exact resume."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gcore.checkpoint.failures import failures, first_line, root_error
from gcore.checkpoint.files import CheckpointError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import ReadItem


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, accepting only DCP's metadata classes (no code from the file runs)."""

    ALLOWED: ClassVar = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:  # noqa: ANN401  as Unpickler.find_class: any allowed global
        if "." not in name:
            if (module, name) in self.ALLOWED:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if module == "torch.distributed.checkpoint.metadata":
                found = super().find_class(module, name)
                if isinstance(found, type) and found.__module__ == module:
                    return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata(path: str) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint ``path``, through ``_MetadataUnpickler``."""
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, AttributeError, ImportError, EOFError) as err:
        raise CheckpointError(f"{file}: refused: {err} (a checkpoint is loaded without running any "
                              "code it contains)") from None


def _safe_reader(path: str) -> FileSystemReader:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader, with ``.metadata`` read by ``_MetadataUnpickler``."""

        def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
            metadata = read_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            assert metadata.storage_meta is not None  # set just above
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _safe_planner() -> DefaultLoadPlanner:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP's planner; a non-tensor item (optimizer settings, scheduler state) must load with
        ``weights_only=True`` before DCP's own ``torch.load`` sees the same bytes."""

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            data = value.read()
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(f"checkpoint item {read_item.dest_index.fqn!r}: refused: it holds Python "
                                      f"objects other than plain data ({str(err).splitlines()[0]})") from None
            super().load_bytes(read_item, io.BytesIO(data))

    return SafePlanner()


def dcp_load(state: dict[str, Any], path: str, process_group: ProcessGroup | None = None) -> None:
    """``dcp.load`` without running code from the files; a mismatch or a refusal is one ``CheckpointError``."""
    import torch.distributed.checkpoint as dcp

    read_metadata(path)  # a refusal here is one line; inside dcp.load torch would log tracebacks first
    try:
        with single_process_is_fine():
            dcp.load(state, checkpoint_id=path, storage_reader=_safe_reader(path), planner=_safe_planner(),
                     process_group=process_group)
    except failures() as err:
        cause = root_error(err)
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"{path}: does not fit this run: {first_line(cause)}") from None


def plain_rng(state: dict[str, Any]) -> dict[str, Any]:
    """``rng_state`` with numpy's array as a tensor, so the whole state loads with ``weights_only=True``."""
    out = dict(state)
    if "numpy" in out:
        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return out


def load_rank_state(file: str) -> dict[str, Any]:
    """A ``rank_<r>.pt``: tensors and plain data only (``weights_only=True``); anything else is refused."""
    import numpy as np

    legacy = []  # files of older gcore versions hold numpy's generator state as an array
    core = getattr(np, "_core", None) or np.core
    for obj in (getattr(core.multiarray, "_reconstruct", None), np.ndarray, np.dtype,
                getattr(getattr(np, "dtypes", None), "UInt32DType", None)):
        if obj is not None:
            legacy.append(obj)
    try:
        with torch.serialization.safe_globals(legacy):
            return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{file}: refused: it holds Python objects other than tensors and plain data, which "
                              f"could run code on load ({str(err).splitlines()[0]})") from None


@contextlib.contextmanager
def single_process_is_fine() -> Iterator[None]:
    """DCP warns when no process group exists; a single-process run is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, Any]:
    """Every random-number generator the step uses, for an exact resume."""
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
