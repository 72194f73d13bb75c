"""Where a checkpoint's files are and whether they are whole: the folder layout (``step_<8 digits>``, the manifest,
the trainer state, the ``hf/`` folder), the complete checkpoints under a root, the SHA-256 check against the
manifest, and the choice of the checkpoint to resume from."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any

from gcore.errors import GcoreError

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


def sha256(path: str) -> str:
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
        if sha256(file) != expected["sha256"]:
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
