"""The run's ``--trainer.heartbeat_timeout`` is the engine-worker pool's liveness deadline."""

from __future__ import annotations

import pytest

from gcore.data import DataConfig
from gcore.model import ModelConfig
from gcore.placement.static import StaticPlacement
from gcore.trainer import Trainer, TrainerConfig
from gcore.types import SamplingParams


@pytest.mark.integration
def test_the_heartbeat_timeout_reaches_the_worker_pool(tmp_path):
    # before: the pool was built with its own 30 s default, whatever --trainer.heartbeat_timeout said
    placement = StaticPlacement(workers=1, threads=1)
    Trainer(
        trainer=TrainerConfig(max_steps=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              heartbeat_timeout=10.0),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(prompts_per_step=1),
        sampling=SamplingParams(n=2, max_new_tokens=4),
        placement=placement,
    ).fit()
    assert placement.pool is not None and placement.pool.liveness_timeout_s == 10.0
