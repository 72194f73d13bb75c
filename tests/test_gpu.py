"""GPU-only checks: skipped without CUDA (see conftest.py). Results are recorded in BENCHMARKS.md."""

import pytest
import torch

from gcore import (
    DataConfig,
    DynamicPlacement,
    HFEngine,
    ModelConfig,
    SamplingParams,
    StaticPlacement,
    Trainer,
    TrainerConfig,
)
from gcore.model import ModelSource, char_tokenizer, materialize

pytestmark = pytest.mark.gpu


def test_sleep_releases_and_wake_up_retakes_device_memory(tmp_path):
    config = ModelConfig(num_hidden_layers=8, hidden_size=1024, intermediate_size=4096)
    path = materialize(config, char_tokenizer(), seed=0, workdir=str(tmp_path / "m"))
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cuda"))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep()
    torch.cuda.synchronize()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_awake >= 0.9 * weight_bytes
    engine.wake_up()
    out = engine.generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4))
    assert len(out[0]) == 2 and next(engine.model.parameters()).is_cuda


def test_fit_on_gpu_with_offloading_engine(tmp_path):
    result = Trainer(
        trainer=TrainerConfig(max_steps=20, accelerator="cuda", default_root_dir=str(tmp_path),
                              enable_progress_bar=False),
        data=DataConfig(prompts_per_step=16),
        placement=StaticPlacement(offload=True),
    ).fit()
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5
    assert all(m["time/swap"] > 0 for m in result.history)


def test_dynamic_placement_on_one_gpu_shares_it_between_engine_workers_and_learns(tmp_path):
    """The default command's placement on one GPU: two engine worker processes share the controller's GPU
    with training; the rule-based reward may take one of them; the reward rises."""
    placement = DynamicPlacement()
    result = Trainer(
        trainer=TrainerConfig(max_steps=20, accelerator="cuda", default_root_dir=str(tmp_path),
                              enable_progress_bar=False),
        data=DataConfig(prompts_per_step=16),
        placement=placement,
    ).fit()
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5
    assert placement.total == 2 and placement.pool is not None and placement.pool.closed  # shut down after the run
    assert all(0 <= m["placement/judge_devices"] <= 1 for m in result.history)
