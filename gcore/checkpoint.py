"""Asynchronous, atomic checkpoints that load on any number of ranks.

Layout of one checkpoint, ``<root>/step_00000010/``:

- ``.metadata``, ``__*.distcp``: the backend's state (model, optimizer, scheduler) written by
  ``torch.distributed.checkpoint`` (DCP), which reshards on load to any rank count;
- ``trainer_state.json``: step, data position, algorithm and placement state (rank 0);
- ``rank_<r>.pt``: per-rank state (random-number generators);
- ``hf/``: the model's HF config and tokenizer (rank 0), so ``gcore export`` needs nothing else;
- ``manifest.json``: written last, with every file's size and SHA-256.

A save writes into ``step_00000010.tmp`` and runs in the background (``dcp.async_save``); the
step's stall is only the copy of the state to CPU memory. When every rank's part is on disk,
rank 0 hashes the files, writes the manifest and renames the folder: a folder without ``.tmp``
and with a manifest is complete. A crash mid-save leaves a ``.tmp`` folder, which is ignored and
cleaned up. ``load`` verifies sizes and hashes and names the file that does not match.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from gcore.errors import GcoreError

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
HF_FILES = "hf"  # the model's config and tokenizer, for export


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


@dataclass
class _PendingSave:
    step: int
    tmp: str
    future: Future
    started: float


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
        self.barrier()
        torch.save(rank_state, os.path.join(tmp, f"rank_{self.rank}.pt"))
        with _single_process_is_fine():
            if asynchronous:
                future = dcp.async_save(backend_state, checkpoint_id=tmp, process_group=self.process_group)
            else:
                dcp.save(backend_state, checkpoint_id=tmp, process_group=self.process_group)
                future = Future()
                future.set_result(None)
        self._pending = _PendingSave(step, tmp, future, start)
        if not asynchronous:
            self.wait()
        return time.perf_counter() - start

    def poll(self) -> None:
        """Finish a save whose writes are done (rank 0 hashes and renames in a background thread)."""
        pending = self._pending
        if pending is None or not pending.future.done():
            return
        pending.future.result()  # re-raise a failed write here, on the training thread
        self._pending = None
        if self.rank == 0:
            self._finalizer = threading.Thread(target=self._finalize, args=(pending,), daemon=True)
            self._finalizer.start()

    def wait(self) -> None:
        """Block until the save in flight is complete and visible."""
        if self._pending is not None:
            self._pending.future.result()
            self.poll()
        if self._finalizer is not None:
            self._finalizer.join()
            self._finalizer = None
        self.barrier()

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

    def load(self, path: str, backend_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Load ``path`` into ``backend_state`` in place (resharded to this run's ranks).

        Returns the trainer state, with ``world_size`` set to the number of ranks that wrote the
        checkpoint, and the state this rank saved, or ``None`` when the checkpoint has none for it
        (it was written by fewer ranks). With a different rank count the caller decides what of the
        rank state still applies (the trainer keeps per-rank prompt streams, reseeds generators).
        """
        import torch.distributed.checkpoint as dcp

        manifest = verify(path)
        with _single_process_is_fine():
            dcp.load(backend_state, checkpoint_id=path, process_group=self.process_group)
        with open(os.path.join(path, TRAINER_STATE)) as f:
            trainer_state = json.load(f)
        trainer_state["world_size"] = manifest["world_size"]
        rank_state = None
        rank_file = os.path.join(path, f"rank_{self.rank}.pt")
        if self.rank < manifest["world_size"]:
            rank_state = torch.load(rank_file, weights_only=False)
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

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def export_hf(checkpoint: str, out_dir: str) -> str:
    """Write the policy of a checkpoint as a plain HF checkpoint (``save_pretrained``).

    The checkpoint's ``hf/`` folder (config and tokenizer, saved with it) describes the model;
    the weights come from the DCP ``model`` state, whatever rank count wrote it.
    """
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    verify(checkpoint)
    hf_dir = os.path.join(checkpoint, HF_FILES)
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{checkpoint}: no {HF_FILES}/ folder with the model's config")
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config)
    state = {"model": model.state_dict()}
    with _single_process_is_fine():
        dcp.load(state, checkpoint_id=checkpoint)
    model.load_state_dict(state["model"])
    model.save_pretrained(out_dir)
    try:
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    except Exception:  # a checkpoint saved without a tokenizer still exports its weights
        pass
    return out_dir


def export_main(argv) -> int:  # noqa: ANN001
    """``gcore export CHECKPOINT --to hf DIR``."""
    import argparse

    parser = argparse.ArgumentParser(prog="gcore export", description="Export a checkpoint's policy.")
    parser.add_argument("checkpoint", help="a checkpoint folder (e.g. .../checkpoints/step_00000010)")
    parser.add_argument("--to", nargs=2, metavar=("FORMAT", "DIR"), required=True, help="hf DIR")
    args = parser.parse_args(list(argv))
    fmt, out_dir = args.to
    if fmt != "hf":
        raise GcoreError(f"gcore export --to {fmt}: valid formats: hf")
    print(f"wrote {export_hf(args.checkpoint.rstrip('/'), out_dir)}")
    return 0
