"""DAPO's dynamic sampling: uniform groups are dropped and the controller re-samples locally."""

import torch

from gcore import DAPO, DataConfig, ModelConfig, RewardModel, SamplingParams, TorchBackend, Trainer, TrainerConfig

TINY = ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64)


class HalfUniformReward(RewardModel):
    """Prompts of digits 0-4 always score 0 (a uniform group); the others score a random number."""

    def score(self, samples):
        return [0.0 if int(s.prompt.answer) < 5 else float(torch.rand(())) for s in samples]


class RecordingBackend(TorchBackend):
    """The torch backend, keeping every batch it trains on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.batches = []

    def train(self, batch, algorithm):
        self.batches.append(batch)
        return super().train(batch, algorithm)


def _fit(tmp_path, algorithm, steps=3):
    backend = RecordingBackend()
    result = Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              save_final=False),
        model=TINY,
        data=DataConfig(prompts_per_step=6),
        sampling=SamplingParams(n=3, max_new_tokens=4),
        reward=HalfUniformReward(),
        algorithm=algorithm,
        backend=backend,
    ).fit()
    return backend.batches, result.history


def test_trained_batch_has_no_uniform_group_and_the_configured_size(tmp_path):
    batches, history = _fit(tmp_path, DAPO(max_rounds=8))
    for batch in batches:
        assert len(batch) == 6 * 3  # prompts_per_step x n, filled by extra rounds
        for group in batch.group_ids.unique():
            rewards = batch.rewards[batch.group_ids == group]
            assert len(rewards) == 3 and (rewards != rewards[0]).any(), batch.rewards
    assert sum(m["filter/groups_dropped"] for m in history) > 0
    assert max(m["filter/rounds_max"] for m in history) >= 2
    assert all(m["filter/groups_trained"] == 6 for m in history)
    assert all(m["samples/trained"] == 18 for m in history)


def test_without_extra_rounds_the_batch_only_shrinks(tmp_path):
    batches, history = _fit(tmp_path, DAPO(max_rounds=1), steps=2)
    for batch, metrics in zip(batches, history, strict=False):
        assert metrics["filter/rounds_max"] == 1
        assert metrics["filter/groups_sampled"] == 6
        assert metrics["filter/groups_trained"] == 6 - metrics["filter/groups_dropped"]
        assert len(batch) == 3 * metrics["filter/groups_trained"]
