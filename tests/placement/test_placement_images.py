"""Image prompts on engine worker processes: the prompts' visual inputs travel with their generation requests, so
static placement with workers, dynamic placement and ``--trainer.max_staleness 1`` train the visual task."""

import math

import pytest

from gcore import DynamicPlacement, StaticPlacement, Trainer, TrainerConfig
from gcore.data import DataConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.mark.parametrize("placement, staleness", [("static", 1), ("dynamic", 0), ("dynamic", 1)])
def test_the_visual_task_trains_on_engine_workers(tmp_path, placement, staleness):
    policy = StaticPlacement(workers=2) if placement == "static" else DynamicPlacement()
    result = Trainer(trainer=TrainerConfig(max_steps=3, default_root_dir=str(tmp_path), enable_progress_bar=False,
                                           save_final=False, max_staleness=staleness),
                     data=DataConfig(task="shape_colour", prompts_per_step=4), placement=policy).fit()
    assert len(result.history) == 3
    # the workers generated from the images: the first step's samples are the policy's own, and the trainer's
    # log-probabilities (recomputed with the images) are the engine's; without the images they would be far off
    assert result.history[0]["rollout/logprob_diff"] < 1e-4
    for metrics in result.history:
        assert metrics["samples/total"] == 32 and math.isfinite(metrics["loss"])
    if staleness:
        assert max(m["async/staleness_max"] for m in result.history) <= 1
