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


@pytest.mark.integration
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


def test_cuda_graph_decoder_matches_the_eager_decoder(tmp_path):
    """``--engine.cuda_graphs``: the replayed graph gives the eager static decoder's greedy tokens, reuses its
    graph for a second batch of the same shape, and recaptures for another shape."""
    config = ModelConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    path = materialize(config, char_tokenizer(), seed=0, workdir=str(tmp_path / "m"))
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7, 10, 11]]
    greedy = SamplingParams(n=2, max_new_tokens=24, temperature=0.0)
    tokens = {}
    for graphs in (False, True):
        engine = HFEngine(cuda_graphs=graphs)
        engine.setup(ModelSource(path), torch.device("cuda"))
        tokens[graphs] = [g.token_ids for group in engine.generate(prompts, greedy) for g in group]
    assert tokens[True] == tokens[False]
    graph = engine._decoder._graph
    assert graph is not None
    engine.generate([[4, 4, 4], [3, 2], [9, 9, 9, 9, 9]], greedy)
    assert engine._decoder._graph is graph  # same shape: replayed, not recaptured
    out = engine.generate(prompts[:1], SamplingParams(n=3, max_new_tokens=8, temperature=1.0))
    assert engine._decoder._graph is not graph and [len(g.token_ids) for g in out[0]] == [8, 8, 8]


def test_engine_workers_take_the_visible_gpus_in_turn(tmp_path):
    """A pool's workers run on cuda:(i % GPUs) (all on the one GPU where there is one) and each generates there
    exactly as an engine in this process does."""
    from gcore.engines.pool import POLICY, RoleSpec, WorkerPool, worker_devices

    path = materialize(ModelConfig(), char_tokenizer(), seed=0, workdir=str(tmp_path / "m"))
    gpus = torch.cuda.device_count()
    pool = WorkerPool(2, {POLICY: RoleSpec(HFEngine(), ModelSource(path))}, [POLICY, POLICY], threads=1,
                      device="cuda:0")
    try:
        assert pool.devices == worker_devices("cuda:0", 2, gpus) == (["cuda:0", "cuda:1"] if gpus > 1 else
                                                                      ["cuda:0", "cuda:0"])
        greedy = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
        reference = HFEngine()
        reference.setup(ModelSource(path), torch.device("cuda:0"))
        expected = [o[0].token_ids for o in reference.generate([[5, 6, 7]], greedy)]
        for worker in (0, 1):
            assert [o[0].token_ids for o in pool.generate(POLICY, [[5, 6, 7]], greedy, [worker])] == expected
    finally:
        pool.close()


def test_three_turn_trajectories_on_the_gpu_are_the_engines_tokens_and_the_trainers_logprobs(tmp_path):
    """The multi-turn token rule on CUDA: the trained ids, masks and behaviour log-probabilities are exactly
    the engine's, and the trainer's log-probabilities of the model tokens match them (as on the CPU)."""
    from conftest import three_turn_trajectory_gap
    from lightning_fabric import Fabric

    from gcore import GRPO, TorchBackend

    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128), tokenizer, seed=0,
                       workdir=str(tmp_path / "m"))
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cuda"))
    backend = TorchBackend()
    backend.setup(Fabric(accelerator="cuda", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=True)
    gap, samples = three_turn_trajectory_gap(engine, backend, tokenizer)
    assert len(samples) == 4 and all(s.turns == 3 for s in samples)
    assert gap < 1e-3  # float32 on CUDA: TF32-free matmuls agree to well under this


@pytest.mark.integration
def test_multi_turn_episodes_train_on_the_gpu_with_dynamic_placement(tmp_path):
    """The reveal task's two-turn episodes on one GPU, generated by two engine workers sharing it."""
    from gcore.envs.reveal import RevealEnvironment

    result = Trainer(
        trainer=TrainerConfig(max_steps=3, accelerator="cuda", default_root_dir=str(tmp_path),
                              enable_progress_bar=False, save_final=False),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(task="reveal", prompts_per_step=4),
        sampling=SamplingParams(n=4, max_new_tokens=6),
        env=RevealEnvironment(),
        placement=DynamicPlacement(workers=2),
    ).fit()
    for metrics in result.history:
        assert metrics["env/episodes"] >= 16 and metrics["env/turns_mean"] == 2.0
        assert metrics.get("env/errors", 0.0) == 0.0
