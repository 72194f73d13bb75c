"""The run's logging: Lightning's loggers, chosen by name (``--trainer.logger``), a resumed run's
``metrics.csv`` continued where it stopped, and dependencies kept quiet on the console."""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
import warnings
from typing import Literal

from lightning_fabric.loggers import CSVLogger, Logger, TensorBoardLogger

from gcore.errors import ConfigError

LoggerName = Literal["csv", "tensorboard", "wandb", "mlflow"]


def make_logger(name: str, root: str, run_name: str, version: int | None = None) -> Logger:
    """A Lightning logger by name; Weights & Biases and MLflow through Lightning's own loggers.

    ``version``: the ``version_N`` folder to write into (a resumed run continues its own); ``None``: a new one.
    """
    if name == "csv":
        return CSVLogger(root, name=run_name, version=version, flush_logs_every_n_steps=1)
    if name == "tensorboard":
        return TensorBoardLogger(root, name=run_name, version=version, default_hp_metric=False)
    if name in ("wandb", "mlflow"):
        missing = [pkg for pkg, mod in ((name, name), ("pytorch-lightning", "pytorch_lightning"))
                   if importlib.util.find_spec(mod) is None]
        if missing:  # Fabric has no W&B or MLflow logger: PyTorch Lightning's work with it
            raise ConfigError(f"--trainer.logger {name} needs {' and '.join(missing)}: pip install 'gcore[{name}]'")
        from pytorch_lightning import loggers

        if name == "wandb":
            return loggers.WandbLogger(name=run_name, save_dir=root)
        return loggers.MLFlowLogger(experiment_name=run_name, save_dir=os.path.join(root, "mlruns"))
    raise ConfigError(f"--trainer.logger {name!r}: valid choices: csv, tensorboard, wandb, mlflow")


def continue_metrics(logger: CSVLogger, start_step: int) -> None:
    """Keep the rows of an existing ``metrics.csv`` before ``start_step`` (the steps a resumed run
    redoes are dropped), across Lightning's writer, which deletes the file when it opens the folder."""
    path = os.path.join(logger.log_dir, "metrics.csv")
    rows, header = [], None
    if start_step > 0 and os.path.isfile(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames
            rows = [row for row in reader if row.get("step") and float(row["step"]) < start_step]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
        writer = logger.experiment  # opens the folder (and deletes metrics.csv in it)
    if header and rows:
        with open(path, "w", newline="") as f:
            csv_writer = csv.DictWriter(f, fieldnames=header)
            csv_writer.writeheader()
            csv_writer.writerows(rows)
        writer.metrics_keys = sorted(header)  # new columns still widen the header; known ones append


def quiet_dependencies() -> None:
    """Keep the console for gcore's own progress: no per-load bars or notices from dependencies."""
    import transformers

    warnings.filterwarnings("ignore", message=r".*all_gather is deprecated")  # inside Fabric's all_gather
    warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")  # DCP, single process
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
