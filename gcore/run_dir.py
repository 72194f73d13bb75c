"""The run's folder (``<default_root_dir>/<name>``): whether the run can write there, before anything is
built, and the loggers' ``version_N`` folder with the run's ``config.yaml``."""

from __future__ import annotations

import errno
import os
import tempfile
from typing import TYPE_CHECKING

import yaml
from lightning_fabric.loggers import CSVLogger

from gcore.checkpointer import Checkpointer, version_number
from gcore.errors import ConfigError
from gcore.loggers import continue_metrics

if TYPE_CHECKING:
    from lightning_fabric import Fabric


def open_run_dir(fabric: Fabric, start_step: int, checkpointer: Checkpointer, hyperparameters: dict) -> str | None:
    """On rank 0: create the loggers' run folder (a resumed run continues its ``metrics.csv``) and
    write ``config.yaml`` there; returns the folder (``None`` without loggers)."""
    if not fabric.loggers:
        return None
    for logger in fabric.loggers:
        if isinstance(logger, CSVLogger):  # a resumed run continues its own metrics.csv
            continue_metrics(logger, start_step)
    # creates the run folder before we write into it (every Lightning logger has ``experiment``)
    _ = fabric.loggers[0].experiment  # type: ignore[attr-defined]
    run_dir = fabric.loggers[0].log_dir
    assert run_dir is not None  # every logger gcore makes writes to a folder
    checkpointer.log_version = version_number(fabric.loggers[0].version)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(hyperparameters, f, sort_keys=False)
    for logger in fabric.loggers:
        if not isinstance(logger, CSVLogger):  # Fabric's CSV logger takes no hyperparameters
            logger.log_hyperparams(hyperparameters)
    return run_dir


def check_run_writable(checkpointer: Checkpointer, root: str, name: str, checkpoint_every: int) -> None:
    """A one-line error, before the model is built, when the run cannot write where it will: the
    checkpoint folder (with ``checkpoint_every``), and the ``version_N`` folder and ``metrics.csv`` a
    resumed run continues (a read-only mount, another user's folder)."""
    run = os.path.join(root, name)
    if checkpoint_every:
        _check_writable(checkpointer.root, "checkpoints are written there (--trainer.checkpoint_every)")
    version = checkpointer.resumed_log_version()
    if version is not None:
        why = "a resumed run continues its metrics (or start a new run with another --trainer.name)"
        folder = os.path.join(run, f"version_{version}")
        _check_writable(folder, why)
        metrics = os.path.join(folder, "metrics.csv")
        if os.path.exists(metrics) and not os.access(metrics, os.W_OK):
            raise ConfigError(f"{metrics}: cannot write there ({os.strerror(errno.EACCES)}); {why}")


def _check_writable(folder: str, why: str) -> None:
    """A one-line ``ConfigError`` when ``folder`` (or, while it does not exist, the nearest folder above it
    that does) takes no new file; ``why`` says what is written there."""
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        _write_probe(existing)
    except OSError as err:
        raise ConfigError(f"{existing}: cannot write there ({err.strerror or err}); {why}") from None


def check_root_writable(root: str) -> None:
    """A one-line error, before any model is built, when runs cannot be written under ``root``."""
    try:
        os.makedirs(root, exist_ok=True)
        _write_probe(root)
    except OSError as err:
        raise ConfigError(f"--trainer.default_root_dir {root}: cannot write there ({err.strerror or err})") from None


def _write_probe(folder: str) -> None:
    """Create and delete a file in ``folder``; raises the ``OSError`` when it takes none."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".gcore-write-test-"):
        pass
