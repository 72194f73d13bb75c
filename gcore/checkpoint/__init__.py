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

One module per job:

- ``files.py``: the layout, the complete checkpoints under a root, ``verify`` against the manifest, the choice of
  the checkpoint to resume from (``pick_checkpoint``, ``resolve_resume``);
- ``manager.py``: writing (``CheckpointManager``: the asynchronous save, its manifest and rename) and loading back;
- ``safe_load.py``: reading without running code (``dcp_load``, ``load_rank_state``) and the generators' state;
- ``failures.py``: a failed save or load in one line (the innermost error, a full disk);
- ``export.py``: ``gcore export`` (``export_hf``).

``gcore/checkpointer.py`` is the run's component above these files: what goes into a checkpoint and when.
"""

from __future__ import annotations

from gcore.checkpoint.export import export_hf, export_main
from gcore.checkpoint.failures import disk_error
from gcore.checkpoint.files import (
    HF_FILES,
    MANIFEST,
    PROCESSOR_FILES,
    STEP_DIR,
    TRAINER_STATE,
    CheckpointError,
    copy_processor_files,
    latest_checkpoint,
    list_checkpoints,
    pick_checkpoint,
    resolve_resume,
    step_dir,
    verify,
)
from gcore.checkpoint.manager import CheckpointManager
from gcore.checkpoint.safe_load import dcp_load, load_rank_state, read_metadata, rng_state, set_rng_state

__all__ = ["HF_FILES", "MANIFEST", "PROCESSOR_FILES", "STEP_DIR", "TRAINER_STATE", "CheckpointError",
           "CheckpointManager", "copy_processor_files", "dcp_load", "disk_error", "export_hf", "export_main",
           "latest_checkpoint", "list_checkpoints", "load_rank_state", "pick_checkpoint", "read_metadata",
           "resolve_resume", "rng_state", "set_rng_state", "step_dir", "verify"]
