"""Writing checkpoints: ``CheckpointManager`` saves a step in the background into a ``.tmp`` folder, finishes it
with the manifest and a rename once every rank's part is on disk, keeps the newest few, and loads one back
(resharded by DCP to this run's ranks)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from gcore.checkpoint.failures import disk_error, failures, first_line, root_error, tree_bytes
from gcore.checkpoint.files import (
    HF_FILES,
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    sha256,
    step_dir,
    verify,
)
from gcore.checkpoint.safe_load import dcp_load, load_rank_state, plain_rng, single_process_is_fine
from gcore.errors import GcoreError


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
        needed = tree_bytes(backend_state) + tree_bytes(rank_state) * self.world_size
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
        except failures() as err:
            self._abandon(tmp, step, err, needed)
        self.barrier()
        try:
            plain = {**rank_state, "rng": plain_rng(rank_state["rng"])} if isinstance(rank_state.get("rng"), dict) \
                else rank_state
            torch.save(plain, os.path.join(tmp, f"rank_{self.rank}.pt"))
            with single_process_is_fine():
                if asynchronous:
                    future = dcp.async_save(backend_state, checkpoint_id=tmp, process_group=self.process_group)
                else:
                    dcp.save(backend_state, checkpoint_id=tmp, process_group=self.process_group)
                    future = Future()
                    future.set_result(None)
        except failures() as err:
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
        cause = root_error(err)
        full = disk_error(f"checkpoint step {step}", self.root, err, needed)
        if full is not None:
            raise CheckpointError(f"{full}; removed the partial {os.path.basename(tmp)}; {kept}") from err
        raise CheckpointError(f"writing checkpoint {tmp} failed ({first_line(cause)}); removed it; {kept}") from err

    def poll(self) -> None:
        """Finish a save whose writes are done (rank 0 hashes and renames in a background thread)."""
        self._raise_finalize_error()
        pending = self._pending
        if pending is None or not pending.future.done():
            return
        self._pending = None
        try:
            pending.future.result()  # re-raise a failed write here, on the training thread
        except failures() as err:
            self._abandon(pending.tmp, pending.step, err, pending.needed)
        if self.rank == 0:
            self._finalizer = threading.Thread(target=self._finalize_or_keep_error, args=(pending,), daemon=True)
            self._finalizer.start()

    def wait(self, barrier: bool = True) -> None:
        """Block until the save in flight is complete and visible (``barrier``: then wait for every rank)."""
        if self._pending is not None:
            with contextlib.suppress(*failures()):  # poll removes the folder and raises the error in one line
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
        except failures() as err:  # raised on the training thread by the next poll or wait
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
                   "sha256": sha256(os.path.join(pending.tmp, name))}
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
