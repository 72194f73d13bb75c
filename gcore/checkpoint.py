"""Asynchronous, atomic checkpoints that load on any number of ranks.

Layout of one checkpoint, ``<root>/step_00000010/``:

- ``.metadata``, ``__*.distcp``: the backend's state (model, optimizer, scheduler) written by
  ``torch.distributed.checkpoint`` (DCP), which reshards on load to any rank count;
- ``trainer_state.json``: step, data position, algorithm and placement state (rank 0);
- ``rank_<r>.pt``: per-rank state (random-number generators) as tensors and plain data, loaded
  with ``torch.load(weights_only=True)``: it can hold no Python objects that run code;
- ``hf/``: the model's HF config and tokenizer (rank 0), so ``gcore export`` needs nothing else;
- ``manifest.json``: written last, with every file's size and SHA-256.

A save writes into ``step_00000010.tmp`` and runs in the background (``dcp.async_save``); the
step's stall is only the copy of the state to CPU memory. When every rank's part is on disk,
rank 0 hashes the files, writes the manifest and renames the folder: a folder without ``.tmp``
and with a manifest is complete. A crash mid-save leaves a ``.tmp`` folder, which is ignored and
cleaned up. ``load`` verifies sizes and hashes and names the file that does not match.

Trust: loading never runs code from the checkpoint. The manifest is not signed (anyone who can
write the folder can rewrite it), so it guards against damage, not tampering; tampering is refused
by what is read: ``rank_<r>.pt`` with ``weights_only=True``, DCP's pickled ``.metadata`` with an
unpickler that accepts only DCP's own metadata classes, and DCP's non-tensor items with
``weights_only=True`` (see docs/failure-modes.md).

A save that fails (a full disk, an unwritable folder) removes its ``.tmp`` folder, leaves the
previous complete checkpoint as it was, and raises a ``CheckpointError`` that names the folder,
and for a full disk the space the checkpoint needed and the space that was free.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gcore.errors import GcoreError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import ReadItem

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
HF_FILES = "hf"  # the model's config and tokenizer, for export
#: a multimodal checkpoint's processor files, copied next to its weights and tokenizer wherever the policy is saved
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def copy_processor_files(source: str, out_dir: str) -> None:
    """Copy the processor files of ``source`` (``PROCESSOR_FILES``, those it has) into ``out_dir``."""
    for name in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(source, name)) and not os.path.isfile(os.path.join(out_dir, name)):
            shutil.copy(os.path.join(source, name), os.path.join(out_dir, name))


class CheckpointError(GcoreError):
    """A checkpoint that is missing, incomplete or corrupted; the message names the file."""


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` (those with a manifest), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(root: str) -> str | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def verify(path: str) -> dict[str, Any]:
    """Check a checkpoint against its manifest; returns the manifest."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path}: no {MANIFEST}: the checkpoint is incomplete")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_path}: corrupted manifest: {err}") from None
    for name, expected in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing from the checkpoint")
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            raise CheckpointError(f"{file}: truncated or corrupted ({size} bytes, manifest says {expected['bytes']})")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file}: corrupted (SHA-256 does not match the manifest)")
    return manifest


def pick_checkpoint(root: str) -> tuple[str | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint under ``root`` that verifies: (path, manifest, notes).

    A corrupt newer one is passed over for the one before it, and a newer folder without a
    manifest (a save that never finished) is noted; ``notes`` has one line for each, to print.
    """
    notes = []
    complete = list_checkpoints(root)
    newest_complete = complete[-1][0] if complete else -1
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            match = STEP_DIR.match(name)
            if match and int(match.group(1)) > newest_complete:
                notes.append(f"{os.path.join(root, name)} has no {MANIFEST} (its save did not finish): skipped")
    for _, path in reversed(complete):
        try:
            return path, verify(path), notes
        except CheckpointError as err:
            notes.append(f"{err}: skipped")
    return None, None, notes


def _tree_bytes(obj: object) -> int:
    """The bytes of the tensors in a nested state (what a save of it writes, roughly); a sharded
    tensor (DTensor) counts with its whole size, as all ranks together write it."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tree_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tree_bytes(v) for v in obj)
    return 0


def _causes(err: BaseException) -> Iterator[BaseException]:
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


def _failures() -> tuple[type[BaseException], ...]:
    """What a failed save or load raises: DCP's ``CheckpointException`` is a ``BaseException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _root_error(err: BaseException) -> BaseException:
    """The innermost error worth naming (DCP wraps every rank's error in a ``CheckpointException``)."""
    for e in _causes(err):
        if isinstance(e, CheckpointError):
            return e
    inner = [e for e in _causes(err) if e is not err and type(e).__name__ != "CheckpointException"]
    return inner[-1] if inner else err


def _free_bytes(path: str) -> int:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path or ".").free


def _is_disk_full(err: BaseException, free: int, needed: int) -> bool:
    for e in _causes(err):
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
        with _single_process_is_fine():
            dcp.load(state, checkpoint_id=path, storage_reader=_safe_reader(path), planner=_safe_planner(),
                     process_group=process_group)
    except _failures() as err:
        cause = _root_error(err)
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"{path}: does not fit this run: {_first_line(cause)}") from None


def _plain_rng(state: dict[str, Any]) -> dict[str, Any]:
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


@dataclass
class _PendingSave:
    step: int
    tmp: str
    future: Future
    started: float
    needed: int = 0


class CheckpointManager:
    """Saves and loads the run's checkpoints under ``root``; one instance per rank.

    Args:
        root: the folder holding ``step_*`` checkpoints.
        keep_last: how many complete checkpoints to keep (older ones are deleted).
        rank, world_size: this process's place in the run.
        barrier: a callable that waits for every rank (``fabric.barrier``).
        process_group: the group for DCP's background collectives (a separate gloo group when
            distributed, so they never interleave with training collectives).
    """

    def __init__(self, root: str, keep_last: int = 2, rank: int = 0, world_size: int = 1,
                 barrier: Callable[[], None] | None = None, process_group=None) -> None:  # noqa: ANN001
        if keep_last < 1:
            raise GcoreError("--trainer.keep_checkpoints must be >= 1")
        self.root, self.keep_last = root, keep_last
        self.rank, self.world_size = rank, world_size
        self.barrier = barrier or (lambda: None)
        self.process_group = process_group
        self._pending: _PendingSave | None = None
        self._finalizer: threading.Thread | None = None
        self.last_completed: str | None = None
        self.last_save_seconds: float = 0.0
        self._finished: list[tuple[int, float]] = []  # (step, seconds from save() to visible), rank 0
        self._finalize_error: tuple[_PendingSave, BaseException] | None = None

    # saving ------------------------------------------------------------------------------

    def save(self, step: int, backend_state: dict[str, Any], trainer_state: dict[str, Any],
             rank_state: dict[str, Any], asynchronous: bool = True, hf_files: str | None = None) -> float:
        """Start writing a checkpoint of ``step``; returns the seconds the caller was stalled.

        ``hf_files``: a folder whose config and tokenizer files are copied into ``hf/`` (rank 0).
        """
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        tmp = step_dir(self.root, step) + ".tmp"
        needed = _tree_bytes(backend_state) + _tree_bytes(rank_state) * self.world_size
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                for stale in os.listdir(self.root):  # leftovers of a crashed save
                    if stale.endswith(".tmp") and os.path.join(self.root, stale) != tmp:
                        shutil.rmtree(os.path.join(self.root, stale), ignore_errors=True)
                with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
                    json.dump(trainer_state, f)
                if hf_files is not None:
                    os.makedirs(os.path.join(tmp, HF_FILES))
                    for name in os.listdir(hf_files):
                        if name.endswith((".json", ".txt", ".model", ".jinja")):  # configs and tokenizer, no weights
                            shutil.copy(os.path.join(hf_files, name), os.path.join(tmp, HF_FILES, name))
        except _failures() as err:
            self._abandon(tmp, step, err, needed)
        self.barrier()
        try:
            plain = {**rank_state, "rng": _plain_rng(rank_state["rng"])} if isinstance(rank_state.get("rng"), dict) \
                else rank_state
            torch.save(plain, os.path.join(tmp, f"rank_{self.rank}.pt"))
            with _single_process_is_fine():
                if asynchronous:
                    future = dcp.async_save(backend_state, checkpoint_id=tmp, process_group=self.process_group)
                else:
                    dcp.save(backend_state, checkpoint_id=tmp, process_group=self.process_group)
                    future = Future()
                    future.set_result(None)
        except _failures() as err:
            self._abandon(tmp, step, err, needed)
        except KeyboardInterrupt:  # interrupted while starting the save: abandon it cleanly
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._pending = _PendingSave(step, tmp, future, start, needed)  # type: ignore[arg-type]  # a Future here
        if not asynchronous:
            self.wait()
        return time.perf_counter() - start

    def _abandon(self, tmp: str, step: int, err: BaseException, needed: int) -> None:
        """A save failed: remove its ``.tmp`` folder and raise one line that says why and what is kept."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(self.root)
        kept = f"the last complete checkpoint is {last}" if last else "there is no complete checkpoint yet"
        cause = _root_error(err)
        full = disk_error(f"checkpoint step {step}", self.root, err, needed)
        if full is not None:
            raise CheckpointError(f"{full}; removed the partial {os.path.basename(tmp)}; {kept}") from err
        raise CheckpointError(f"writing checkpoint {tmp} failed ({_first_line(cause)}); removed it; {kept}") from err

    def poll(self) -> None:
        """Finish a save whose writes are done (rank 0 hashes and renames in a background thread)."""
        self._raise_finalize_error()
        pending = self._pending
        if pending is None or not pending.future.done():
            return
        self._pending = None
        try:
            pending.future.result()  # re-raise a failed write here, on the training thread
        except _failures() as err:
            self._abandon(pending.tmp, pending.step, err, pending.needed)
        if self.rank == 0:
            self._finalizer = threading.Thread(target=self._finalize_or_keep_error, args=(pending,), daemon=True)
            self._finalizer.start()

    def wait(self, barrier: bool = True) -> None:
        """Block until the save in flight is complete and visible (``barrier``: then wait for every rank)."""
        if self._pending is not None:
            with contextlib.suppress(*_failures()):  # poll removes the folder and raises the error in one line
                self._pending.future.result()
            self.poll()
        if self._finalizer is not None:
            self._finalizer.join()
            self._finalizer = None
        self._raise_finalize_error()
        if barrier:
            self.barrier()

    def finish_for_exit(self) -> str | None:
        """On an interrupt: complete the save in flight (its data is mostly on disk already) without
        waiting for other ranks; a second interrupt abandons it (its ``.tmp`` folder is removed).

        Returns the newest complete checkpoint (``None``: none), where the run can be resumed from.
        """
        pending = self._pending
        try:
            self.wait(barrier=False)
        except KeyboardInterrupt:
            if pending is not None and self.rank == 0:
                shutil.rmtree(pending.tmp, ignore_errors=True)
        except CheckpointError as err:
            import sys

            print(f"gcore: {err}", file=sys.stderr, flush=True)
        return latest_checkpoint(self.root)

    def _raise_finalize_error(self) -> None:
        failed, self._finalize_error = self._finalize_error, None
        if failed is not None and (self._finalizer is None or not self._finalizer.is_alive()):
            pending, err = failed
            self._abandon(pending.tmp, pending.step, err, pending.needed)
        elif failed is not None:
            self._finalize_error = failed

    def _finalize_or_keep_error(self, pending: _PendingSave) -> None:
        try:
            self._finalize(pending)
        except _failures() as err:  # raised on the training thread by the next poll or wait
            self._finalize_error = (pending, err)

    def take_finished(self) -> list[tuple[int, float]]:
        """Saves completed since the last call: (step, seconds from ``save`` until visible); rank 0 only."""
        finished, self._finished = self._finished, []
        return finished

    def _finalize(self, pending: _PendingSave) -> None:
        # rank 0's DCP future completes only after every rank's write (its metadata step gathers them)
        expected = {f"rank_{r}.pt" for r in range(self.world_size)}
        present = set(os.listdir(pending.tmp))
        if not expected <= present:
            raise CheckpointError(f"{pending.tmp}: missing {sorted(expected - present)}")
        names = sorted(
            os.path.relpath(os.path.join(folder, f), pending.tmp)
            for folder, _, filenames in os.walk(pending.tmp) for f in filenames
        )
        files = {
            name: {"bytes": os.path.getsize(os.path.join(pending.tmp, name)),
                   "sha256": _sha256(os.path.join(pending.tmp, name))}
            for name in names
        }
        manifest = {"step": pending.step, "world_size": self.world_size, "files": files,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(os.path.join(pending.tmp, MANIFEST + ".part"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(pending.tmp, MANIFEST + ".part"), os.path.join(pending.tmp, MANIFEST))
        final = step_dir(self.root, pending.step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(pending.tmp, final)
        self.last_completed = final
        self.last_save_seconds = time.perf_counter() - pending.started
        self._finished.append((pending.step, self.last_save_seconds))
        for _, old in list_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # loading -----------------------------------------------------------------------------

    def load(self, path: str, backend_state: dict[str, Any],
             manifest: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Load ``path`` into ``backend_state`` in place (resharded to this run's ranks).

        Returns the trainer state, with ``world_size`` set to the number of ranks that wrote the
        checkpoint, and the state this rank saved, or ``None`` when the checkpoint has none for it
        (it was written by fewer ranks). With a different rank count the caller decides what of the
        rank state still applies (the trainer keeps per-rank prompt streams, reseeds generators).
        ``manifest``: the checkpoint's, already verified (by ``pick_checkpoint``); else it is verified here.
        """
        manifest = manifest or verify(path)
        rank_state = None
        if self.rank < manifest["world_size"]:  # first: refuse a planted file before anything else is read
            rank_state = load_rank_state(os.path.join(path, f"rank_{self.rank}.pt"))
        dcp_load(backend_state, path, self.process_group)
        with open(os.path.join(path, TRAINER_STATE)) as f:
            trainer_state = json.load(f)
        trainer_state["world_size"] = manifest["world_size"]
        return trainer_state, rank_state


@contextlib.contextmanager
def _single_process_is_fine() -> Iterator[None]:
    """DCP warns when no process group exists; a single-process run is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def resolve_resume(resume: str | None, root: str) -> str | None:
    """``auto`` -> the latest complete checkpoint under ``root`` (or None); a path -> that path."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        return latest_checkpoint(root)
    path = resume.rstrip("/")
    if not os.path.isdir(path):
        raise CheckpointError(f"--trainer.resume {resume}: no such checkpoint folder")
    if path.endswith(".tmp"):
        raise CheckpointError(f"--trainer.resume {resume}: an incomplete checkpoint (a save that did not finish)")
    return path


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


def export_hf(checkpoint: str, out_dir: str, trust_remote_code: bool = False) -> str:
    """Write the policy of a checkpoint as a plain HF checkpoint (``save_pretrained``).

    The checkpoint's ``hf/`` folder (config and tokenizer, saved with it) describes the model;
    the weights come from the DCP ``model`` state, whatever rank count wrote it. No code from the
    checkpoint runs: config, model and tokenizer load with ``trust_remote_code=False`` (transformers
    never prompts), and an ``hf/`` folder that names code of its own (``auto_map``) is refused unless
    ``trust_remote_code`` (``gcore export --trust-remote-code``, the user's choice, not the checkpoint's).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    hf_dir = os.path.join(checkpoint, HF_FILES)
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{checkpoint}: no {HF_FILES}/ folder with the model's config")
    for name in ("config.json", "tokenizer_config.json"):
        file = os.path.join(hf_dir, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file) as f:
                auto_map = json.load(f).get("auto_map")
        except (OSError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{file}: not a JSON object ({err})") from None
        if auto_map and not trust_remote_code:
            classes = ", ".join(map(str, auto_map.values() if isinstance(auto_map, dict) else auto_map))
            raise CheckpointError(f"{file} names custom code ({classes}): gcore export runs no code from a "
                                  "checkpoint; pass --trust-remote-code only if you trust this checkpoint's code")
    verify(checkpoint)
    try:
        config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
        image_text = getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        auto_class = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
        model = auto_class.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{hf_dir}: cannot build the model from its config: {type(err).__name__}: "
                              f"{' '.join(str(err).split())}") from None
    state = {"model": model.state_dict()}
    dcp_load(state, checkpoint)
    model.load_state_dict(state["model"])
    model.save_pretrained(out_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  a checkpoint saved without a tokenizer still exports its weights
        pass
    else:
        tokenizer.save_pretrained(out_dir)
    copy_processor_files(hf_dir, out_dir)  # an image-text-to-text model's processor (AutoProcessor loads it)
    return out_dir


def export_main(argv) -> int:  # noqa: ANN001
    """``gcore export CHECKPOINT --to hf DIR [--trust-remote-code]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="gcore export", description="Export a checkpoint's policy.")
    parser.add_argument("checkpoint", help="a checkpoint folder (e.g. .../checkpoints/step_00000010)")
    parser.add_argument("--to", nargs=2, metavar=("FORMAT", "DIR"), required=True, help="hf DIR")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a checkpoint whose config names code of its own (auto_map) and run that code; "
                        "off by default: export runs no code from the checkpoint")
    args = parser.parse_args(list(argv))
    fmt, out_dir = args.to
    if fmt != "hf":
        raise GcoreError(f"gcore export --to {fmt}: valid formats: hf")
    print(f"wrote {export_hf(args.checkpoint.rstrip('/'), out_dir, args.trust_remote_code)}")
    return 0
