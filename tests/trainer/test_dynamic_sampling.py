"""DAPO's dynamic sampling: uniform groups are dropped and the controller re-samples locally."""

import pytest
import torch

from gcore import DAPO, GRPO, DataConfig, ModelConfig, RewardModel, SamplingParams, TorchBackend, Trainer, TrainerConfig

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


def _fit(tmp_path, algorithm, steps=3, **trainer):
    backend = RecordingBackend()
    result = Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              save_final=False, **trainer),
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


def test_oversample_draws_the_extra_prompts_up_front_from_the_last_keep_rate(tmp_path):
    """About half the groups are uniform: without ``oversample`` nearly every step draws a second round once its
    verdicts are in; with it, each step after the first starts with enough extra prompts (``prompts_to_draw`` at the
    last step's keep rate, 90% sure) and the batch is still the configured size with no uniform group."""
    from gcore.inflight import prompts_to_draw

    plain_batches, plain = _fit(tmp_path / "plain", DAPO(max_rounds=8), steps=5)
    batches, history = _fit(tmp_path / "over", DAPO(max_rounds=8), steps=5, oversample=True)
    for batch in batches:
        assert len(batch) == 6 * 3
        for group in batch.group_ids.unique():
            rewards = batch.rewards[batch.group_ids == group]
            assert (rewards != rewards[0]).any(), batch.rewards
    assert all(m["filter/groups_trained"] == 6 for m in history)
    assert history[0]["filter/groups_sampled"] == plain[0]["filter/groups_sampled"]  # no keep rate before step 0
    for before, metrics in zip(history, history[1:], strict=False):  # each step's first round, from the step before
        keep = (before["filter/groups_trained"] + before["filter/groups_surplus"]) / before["filter/groups_sampled"]
        assert metrics["filter/groups_sampled"] >= prompts_to_draw(6, keep)
    second_rounds = sum(m["filter/rounds_max"] > 1 for m in history[1:])
    assert second_rounds <= 1 < sum(m["filter/rounds_max"] > 1 for m in plain[1:])
    assert sum(m["filter/groups_surplus"] for m in history) > 0  # the price: kept groups that are not trained


def test_oversample_without_dynamic_sampling_is_refused_in_one_line(tmp_path):
    from gcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--trainer.oversample true .* GRPO .*--algorithm dapo"):
        _fit(tmp_path, GRPO(), steps=1, oversample=True)


def test_prompts_to_draw_keeps_the_share_with_the_asked_confidence():
    from gcore.inflight import prompts_to_draw

    torch.manual_seed(0)
    assert prompts_to_draw(0, 0.5) == 0  # a controller with no prompts this step draws none
    assert prompts_to_draw(6, 1.0) == 6 and prompts_to_draw(6, 0.0) == 30 and prompts_to_draw(6, 0.01) == 30
    for target, keep in [(6, 0.5), (16, 0.3), (64, 0.8), (256, 0.5)]:
        drawn = prompts_to_draw(target, keep)
        kept_enough = sum(torch.binomial(torch.full((4000,), float(drawn)), torch.full((4000,), keep)) >= target)
        assert float(kept_enough) / 4000 >= 0.88, (target, keep, drawn)  # 0.9 asked; the approximation errs high
        fewer = sum(torch.binomial(torch.full((4000,), float(drawn - 2)), torch.full((4000,), keep)) >= target)
        assert float(fewer) / 4000 < 0.97, (target, keep, drawn)  # and not far above it
