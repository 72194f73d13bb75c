"""The run's checkpoint component: what goes into a checkpoint, when, and how a run resumes from one.

The trainer builds one ``Checkpointer`` per run and hands it the stateful parts once
(``setup(fabric, backend, shared={...}, own={...})``); the loop then calls ``save(step)`` after
every step and the setup ``load()`` once. ``gcore/checkpoint.py`` writes and reads the files (DCP,
the manifest, atomic renames, the safe loaders); this module decides what they hold:

- the backend's state (weights, optimizer, scheduler), through DCP, resharded on load;
- ``trainer_state.json`` (rank 0): the loop's own state (step, seed, rank count, the run's
  signature, the ``version_N`` its metrics go to) and every *shared* part's ``state_dict()`` (the
  global prompt stream, the algorithm, the placement policy): parts every rank holds alike;
- ``rank_<r>.pt``: this rank's random generators and its *own* parts (its dynamic-sampling stream);
- a part in *halves* (the rollouts in flight: the prompts drawn ahead, alike on every rank, and this
  rank's share of them with its rollouts) has one half in each, under its name.

A part is anything with ``state_dict()`` and ``load_state_dict(state)``; a new piece of resumable
state is one more entry in ``shared``, ``own`` or ``halves``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from gcore.checkpoint import (
    TRAINER_STATE,
    CheckpointError,
    CheckpointManager,
    copy_processor_files,
    disk_error,
    latest_checkpoint,
    pick_checkpoint,
    resolve_resume,
    rng_state,
    set_rng_state,
    verify,
)
from gcore.errors import ConfigError, GcoreError

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from lightning_fabric import Fabric


class Stateful(Protocol):
    """A part of the run that a checkpoint holds."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Weights(Protocol):
    """What the checkpointer needs of the training backend."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]: ...

    def save_pretrained(self, folder: str, /) -> None: ...


class Tokenizer(Protocol):
    def save_pretrained(self, save_directory: str, /) -> object: ...


class Checkpointer:
    """Saves the run every ``every`` steps under ``root`` and resumes it (``resume``).

    Args:
        root: ``<default_root_dir>/<name>/checkpoints``.
        every: save after every N-th step and after the last (0: never).
        keep: how many complete checkpoints to keep.
        asynchronous: write in the background while training goes on.
        resume: ``None``, ``auto`` or a checkpoint folder (``--trainer.resume``).
        seed: the run's seed (a resharded resume reseeds from it).
        signature: what a checkpoint must match to be resumed by this run (algorithm, backend,
            model shape, and unless ``allow_changed_run``, seed and data), as ``Trainer`` describes the run.
        collective_timeout: seconds the background save's own process group may wait.
    """

    def __init__(self, root: str, *, every: int, keep: int, asynchronous: bool, resume: str | None, seed: int,
                 signature: dict[str, Any], collective_timeout: float, allow_changed_run: bool = False) -> None:
        self.root, self.every, self.keep, self.asynchronous = root, every, keep, asynchronous
        self.resume, self.seed, self.signature = resume, seed, signature
        self.collective_timeout, self.allow_changed_run = collective_timeout, allow_changed_run
        self.resume_from: str | None = None  # the checkpoint ``load`` continues (``pick``)
        self.max_steps = 0  # the run's ``--trainer.max_steps`` (``pick``)
        self._manifest: dict[str, Any] | None = None
        self._saved: dict[str, Any] | None = None  # its ``trainer_state.json``, read once by ``pick``
        #: the ``version_N`` the run's metrics go to, written into every checkpoint (rank 0 sets it)
        self.log_version: int | None = None

    # before any process exists ---------------------------------------------------------------

    def pick(self, max_steps: int) -> None:
        """Choose and verify the checkpoint to resume from; with ``auto``, a corrupt newest one is passed
        over for the one before it, with one line that says so. Fails at once when it has nothing
        left to train."""
        self.max_steps = max_steps
        if self.resume != "auto":
            path = resolve_resume(self.resume, self.root)
            self.resume_from, self._manifest = (path, verify(path)) if path else (None, None)
        else:
            self.resume_from, self._manifest, notes = pick_checkpoint(self.root)
            if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
                for note in notes:
                    print(f"gcore: warning: {note}", file=sys.stderr, flush=True)
        if self.resume_from is not None:
            try:
                with open(os.path.join(self.resume_from, TRAINER_STATE), encoding="utf-8") as f:
                    self._saved = json.load(f)
                start = int(self._saved["step"]) + 1
            except Exception:  # noqa: BLE001  a broken one: ``load`` itself says which file
                self._saved = None
                return
            self._check_steps(start)
            self._check_signature(self.resume_from, self._saved.get("run"))

    def resumed_log_version(self) -> int | None:
        """The ``version_N`` a resumed run continues: the one its checkpoint names, else the newest."""
        if self.resume_from is None:
            return None
        version = (self._saved or {}).get("log_version")
        if isinstance(version, int):
            return version
        run_root = os.path.dirname(self.root)
        versions = [version_number(name) for name in os.listdir(run_root)] if os.path.isdir(run_root) else []
        found = [v for v in versions if v is not None]
        return max(found) if found else None

    # in every controller ---------------------------------------------------------------------

    def setup(self, fabric: Fabric, backend: Weights, shared: Mapping[str, Stateful],
              own: Mapping[str, Stateful], halves: Mapping[str, Stateful] | None = None,
              hf_files: str | None = None) -> None:
        """Hand over the run's stateful parts: ``backend`` (DCP), ``shared`` (every rank holds the same;
        written once, by rank 0), ``own`` (this rank's) and ``halves`` (parts whose ``state_dict()`` is
        ``{"shared": ..., "own": ...}``, loaded back as such, with ``own`` ``None`` on a rank that wrote none);
        ``hf_files``: the folder whose config and tokenizer files go into every checkpoint's ``hf/``
        (``gcore export`` needs nothing else)."""
        import torch.distributed as dist

        self.fabric, self.backend, self.shared, self.own, self.hf_files = fabric, backend, shared, own, hf_files
        self.halves: Mapping[str, Stateful] = halves or {}
        group = None
        # whenever a process group exists: several ranks, or one whose strategy started a one-rank group, as FSDP
        # does; DCP would use that group, and an NCCL-only group cannot run an asynchronous save
        if dist.is_initialized() and (self.every or self.resume):
            from datetime import timedelta

            # DCP's background collectives stay off the training group, on a backend that moves CPU tensors
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.collective_timeout))
        self.files = CheckpointManager(self.root, self.keep, fabric.global_rank, fabric.world_size,
                                       barrier=fabric.barrier, process_group=group)

    def load(self) -> int:
        """Restore the checkpoint ``pick`` chose, if any; returns the first step to run (0: none).

        On the rank count that wrote it, everything continues exactly. On another rank count
        (elastic resume) the weights, optimizer and scheduler are resharded by DCP; the shared parts
        (the global prompt stream and the learnt lengths) continue as they were; a rank that existed
        before keeps its own parts (its dynamic-sampling prompt stream), a new rank starts its own;
        the random generators are reseeded from the seed, the rank and the step.
        """
        fabric, path = self.fabric, self.resume_from
        rank = fabric.global_rank
        if path is None:
            if self.resume == "auto" and rank == 0:
                print(f"no checkpoint under {self.root}: starting from step 0")
            return 0
        state = self.backend.state_dict()  # ``pick`` checked the steps and the run's signature
        trainer_state, rank_state = self.files.load(path, state, self._manifest)
        self.backend.load_state_dict(state)
        for name, part in self.shared.items():
            if name in trainer_state:  # checkpoints of older runs may lack a plugin's state
                part.load_state_dict(trainer_state[name])
        for name, part in self.own.items():
            if rank_state is not None and name in rank_state:
                part.load_state_dict(rank_state[name])
        for name, part in self.halves.items():
            part.load_state_dict({"shared": trainer_state.get(name),
                                  "own": rank_state.get(name) if rank_state is not None else None})
        start = int(trainer_state["step"]) + 1
        saved_world = int(trainer_state["world_size"])
        if saved_world == fabric.world_size:
            assert rank_state is not None  # every rank that wrote the checkpoint has its file
            set_rng_state(rank_state["rng"])  # same rank count: continue exactly
        else:
            fabric.seed_everything(self.seed + rank + 100_003 * start, verbose=False)  # resharded: reseed
        if rank == 0:
            print(f"resumed from {path} at step {start}")
            if saved_world != fabric.world_size:
                print(self._elastic_note(saved_world))
        return start

    def save(self, step: int, last_step: bool = False) -> dict[str, float]:
        """Finish saves whose writes are done; start this step's save when one is due (every
        ``every`` steps, and after the ``last_step``).

        Returns the metrics to log with this step: ``checkpoint/stall_s``, the seconds training
        waited for the save it started (with async saves, only the copy of the state to memory, and the
        parts' state: with ``--trainer.max_staleness``, the generation of the rollouts in flight),
        and ``checkpoint/write_s``, the seconds a save took until it was complete and visible
        (rank 0, when one completes).
        """
        metrics: dict[str, float] = {}
        self.files.poll()
        for _, seconds in self.files.take_finished():
            metrics["checkpoint/write_s"] = seconds
        if self.every and ((step + 1) % self.every == 0 or last_step):
            started = time.perf_counter()  # a part's state may take a wait (the rollouts in flight: their generation)
            shared = {"step": step, **{name: part.state_dict() for name, part in self.shared.items()},
                      "seed": self.seed, "world_size": self.fabric.world_size, "run": self.signature,
                      "log_version": self.log_version}
            own = {"rng": rng_state(), **{name: part.state_dict() for name, part in self.own.items()}}
            for name, part in self.halves.items():
                state = part.state_dict()
                shared[name], own[name] = state["shared"], state["own"]
            parts_s = time.perf_counter() - started
            metrics["checkpoint/stall_s"] = parts_s + self.files.save(step, self.backend.state_dict(), shared, own,
                                                                      asynchronous=self.asynchronous,
                                                                      hf_files=self.hf_files)
        return metrics

    def wait(self) -> None:
        """Block until the save in flight is complete, on every rank."""
        self.files.wait()

    def finish_for_exit(self) -> str | None:
        """On an interrupt: complete the save in flight without waiting for other ranks (a second
        interrupt abandons it); returns the newest complete checkpoint, ``None`` if there is none."""
        return self.files.finish_for_exit()

    def save_final(self, final_dir: str, tokenizer: Tokenizer) -> str:
        """Write the trained policy to ``final_dir`` as an HF checkpoint, atomically (``final.tmp``,
        then renamed).

        When that fails (a full disk), the half-written folder is removed and the policy is written
        to the temp dir instead; the error says where the weights are, so they are never lost silently.
        """

        def write(folder: str) -> None:
            shutil.rmtree(folder, ignore_errors=True)
            self.backend.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            if self.hf_files is not None:  # an image-text-to-text model's processor
                copy_processor_files(self.hf_files, folder)

        tmp = final_dir + ".tmp"
        try:
            write(tmp)
            shutil.rmtree(final_dir, ignore_errors=True)
            os.replace(tmp, final_dir)
            return final_dir
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            needed = sum(w.numel() * w.element_size() for _, w in self.backend.named_weights())
            reason = (disk_error("the final policy", os.path.dirname(final_dir), err, needed)
                      or f"writing the final policy to {final_dir} failed ({type(err).__name__}: {err})")
            fallback = tempfile.mkdtemp(prefix="gcore-final-")
            try:
                write(fallback)
                kept = f"the trained policy was saved to {fallback} instead"
            except Exception:  # noqa: BLE001  the fallback failing in any way is reported below
                shutil.rmtree(fallback, ignore_errors=True)
                last = latest_checkpoint(self.root)
                kept = (f"it could not be written to the temp dir either; the newest checkpoint is {last}" if last
                        else "it could not be written to the temp dir either, and no checkpoint holds it: "
                        "the trained weights are lost (free space, or use --trainer.checkpoint_every)")
            raise GcoreError(f"{reason}; {kept}") from err

    # what the above are made of --------------------------------------------------------------

    def _check_steps(self, start: int) -> None:
        """Fail when the checkpoint to resume from is already past ``--trainer.max_steps``."""
        if start > self.max_steps:
            raise ConfigError(f"--trainer.max_steps {self.max_steps} is below the {start} steps already trained in "
                              f"the checkpoint {self.resume_from}: nothing to train; pass a larger "
                              "--trainer.max_steps to go on")

    def _check_signature(self, path: str, saved: dict | None) -> None:
        if not saved:
            return  # written by an older gcore: DCP's own checks still name a shape mismatch
        mine = self.signature
        flags = {"algorithm": "--algorithm", "backend": "--backend"}
        for key in ("algorithm", "backend"):
            if saved.get(key) != mine[key]:
                raise CheckpointError(f"{path} was written by a run with {flags[key]} {saved.get(key)}, this run has "
                                      f"{mine[key]}: resume with the same {flags[key]}, or start a new run "
                                      "(another --trainer.name)")
        differ = [f"--model.{k} {v} (this run: {mine['model'].get(k)})" for k, v in saved.get("model", {}).items()
                  if k != "path" and mine["model"].get(k) != v]
        if differ:
            raise CheckpointError(f"{path} was written with another model: {', '.join(differ)}; resume with the "
                                  "same model options, or start a new run (another --trainer.name)")
        changed = [f"{flag} {saved[key]} (this run: {mine[key]})" for key, flag in
                   (("seed", "--trainer.seed"), ("data", "--data"))
                   if key in saved and saved[key] != mine.get(key)]  # older checkpoints record neither
        if changed and not self.allow_changed_run:
            raise CheckpointError(f"{path} was written by another run: {', '.join(changed)}; resume with the same "
                                  "options, start a new run (another --trainer.name), or pass "
                                  "--trainer.resume_changed_run true to continue it anyway")

    def _elastic_note(self, saved_world: int) -> str:
        world = self.fabric.world_size
        kept = min(saved_world, world)
        where = ", ".join(f"{name} at {_position(part)}" for name, part in self.shared.items() if _position(part))
        return (f"elastic resume: written by {saved_world} controller(s), running on {world}: weights and "
                f"optimizer resharded, {where or 'shared state restored'}, controller(s) {_span(0, kept)} keep "
                f"their own {', '.join([*self.own, *self.halves]) or 'state'}, "
                + (f"{_span(kept, world)} start their own" if world > kept else f"those of {_span(kept, saved_world)} "
                   "are dropped")
                + "; random generators reseeded")


def version_number(version: object) -> int | None:
    """``3``, ``"version_3"`` -> 3; anything else -> None."""
    if isinstance(version, int):
        return version
    if isinstance(version, str) and version.startswith("version_") and version[8:].isdigit():
        return int(version[8:])
    return None


def _position(part: object) -> str:
    """Where a prompt stream stands (``epoch E position P``), or ``""`` for other parts."""
    epoch, position = getattr(part, "epoch", None), getattr(part, "position", None)
    return f"epoch {epoch} position {position}" if isinstance(epoch, int) and isinstance(position, int) else ""


def _span(first: int, end: int) -> str:
    """Ranks ``first..end-1`` as text: ``1`` or ``1-3``."""
    return str(first) if end - first == 1 else f"{first}-{end - 1}"
