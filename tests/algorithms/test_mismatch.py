"""Training-inference mismatch corrections (``--algorithm.mismatch_correction``): each mode against a hand
computation, the loss it weighs, the one-line errors, and the ``mismatch/*`` metrics through the torch backend
(a maximum over micro-batches, not a mean) and in a 2-step run on the tiny default model."""

import csv
import math
import os

import pytest
import torch
from lightning_fabric import Fabric

from gcore import GRPO, PPO, TorchBackend
from gcore.algorithms.base import LossScale
from gcore.algorithms.mismatch import correction_weight
from gcore.errors import ConfigError
from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize
from gcore.testing import make_batch, set_up, tiny_fit

# two rows of four tokens; the first token of each and the last of row 1 are not response tokens, and their
# log-ratios (9 and 5) must change nothing. Row 0's ratios are 3, 0.5, 1 (product 1.5, geometric mean 1.1447),
# row 1's 1.5, 1.6 (product 2.4, geometric mean 1.5492).
MASK = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float64)
LOG_RATIO = torch.tensor([[9.0, math.log(3.0), math.log(0.5), 0.0],
                          [0.0, math.log(1.5), math.log(1.6), 5.0]], dtype=torch.float64)

EXPECTED = {  # (mode, low, high): (weights, corrected), written out by hand
    ("token_truncate", 0.6, 2.0): ([[1, 2.0, 0.6, 1], [1, 1.5, 1.6, 1]], [[0, 1, 1, 0], [0, 0, 0, 0]]),
    ("token_truncate", None, 2.0): ([[1, 2.0, 0.5, 1], [1, 1.5, 1.6, 1]], [[0, 1, 0, 0], [0, 0, 0, 0]]),
    ("token_mask", 0.6, 2.0): ([[1, 0, 0, 1], [1, 1.5, 1.6, 1]], [[0, 1, 1, 0], [0, 0, 0, 0]]),
    ("token_mask", None, 1.55): ([[1, 0, 0.5, 1], [1, 1.5, 0, 1]], [[0, 1, 0, 0], [0, 0, 1, 0]]),
    ("sequence_truncate", 0.6, 2.0): ([[1, 1.5, 1.5, 1.5], [1, 2.0, 2.0, 1]], [[0, 0, 0, 0], [0, 1, 1, 0]]),
    ("sequence_truncate", 1.6, 3.0): ([[1, 1.6, 1.6, 1.6], [1, 2.4, 2.4, 1]], [[0, 1, 1, 1], [0, 0, 0, 0]]),
    ("sequence_mask", 0.6, 2.0): ([[1, 1.5, 1.5, 1.5], [1, 0, 0, 1]], [[0, 0, 0, 0], [0, 1, 1, 0]]),
    ("geometric_mask", 0.9, 1.2): ([[1, 1, 1, 1], [1, 0, 0, 1]], [[0, 0, 0, 0], [0, 1, 1, 0]]),
    ("geometric_mask", 0.9, 1.1): ([[1, 0, 0, 0], [1, 0, 0, 1]], [[0, 1, 1, 1], [0, 1, 1, 0]]),
}


@pytest.mark.parametrize(("mode", "low", "high"), list(EXPECTED))
def test_each_correction_by_hand(mode, low, high):
    weights, corrected = correction_weight(LOG_RATIO, MASK, mode, low, high)
    expected_weights, expected_corrected = EXPECTED[(mode, low, high)]
    torch.testing.assert_close(weights, torch.tensor(expected_weights, dtype=torch.float64))
    torch.testing.assert_close(corrected, torch.tensor(expected_corrected, dtype=torch.float64))


def _batch_with_ratios():
    """Two rows whose response tokens have engine-vs-trainer ratios 3, 0.5 (row 0) and 1.5, 1 (row 1), with the
    trainer's log-probabilities 0 and advantages +1, -1."""
    batch = make_batch([1.0, 0.0], [0, 0])  # response mask [[0, 1, 1], [0, 1, 1]]
    batch.engine_logprobs = -torch.log(torch.tensor([[1.0, 3.0, 0.5], [1.0, 1.5, 1.0]]))
    batch.advantages = torch.tensor([1.0, -1.0])
    return batch


def test_token_mask_weighs_the_loss_and_logs_the_mismatch():
    batch, logprobs = _batch_with_ratios(), torch.zeros(2, 3, requires_grad=True)
    scale = LossScale(tokens=4.0, sequences=2.0, max_length=3.0)
    loss, shares = GRPO(mismatch_correction="token_mask", mismatch_low=0.6).loss(logprobs, batch, scale)
    # per token -A * w: row 0's two tokens are masked (3 > 2, 0.5 < 0.6); row 1's weigh 1.5 and 1
    assert loss.item() == pytest.approx((0.0 + (1.5 + 1.0) / 2) / 2)
    assert shares["mismatch/masked_frac"].item() == pytest.approx(2 / 4)
    mean = (math.log(3) + math.log(2) + math.log(1.5)) / 4
    assert shares["mismatch/abs_log_ratio_mean"].item() == pytest.approx(mean)
    assert shares["mismatch/abs_log_ratio_max"].item() == pytest.approx(math.log(3))
    loss.backward()  # masked tokens get no gradient
    assert logprobs.grad is not None and logprobs.grad[0].abs().sum() == 0 and logprobs.grad[1].abs().sum() > 0
    # the default (none) leaves a synchronous batch unweighed, as before: the two rows cancel
    plain, shares = GRPO().loss(torch.zeros(2, 3), _batch_with_ratios(), scale)
    assert plain.item() == pytest.approx(0.0)
    assert shares["mismatch/masked_frac"].item() == 0.0
    assert shares["mismatch/abs_log_ratio_max"].item() == pytest.approx(math.log(3))


def test_a_correction_replaces_the_behaviour_cap_off_policy():
    """Off-policy (behaviour log-probabilities set) the ratio is the same proximal-vs-behaviour one; ``none``
    keeps ``behaviour_is_cap``'s truncation, a mode replaces it."""
    scale = LossScale(tokens=4.0, sequences=2.0, max_length=3.0)
    batch = _batch_with_ratios()
    batch.behaviour_logprobs = batch.engine_logprobs.clone()
    capped, shares = GRPO(behaviour_is_cap=2.0).loss(torch.zeros(2, 3), batch, scale)
    assert capped.item() == pytest.approx(((-2.0 - 0.5) / 2 + (1.5 + 1.0) / 2) / 2)
    assert shares["mismatch/masked_frac"].item() == shares["async/behaviour_truncated_frac"].item() == 0.25
    masked, shares = GRPO(mismatch_correction="sequence_mask").loss(torch.zeros(2, 3), batch, scale)
    assert masked.item() == pytest.approx(((-1.5 - 1.5) / 2 + (1.5 + 1.5) / 2) / 2)  # products 1.5 and 1.5
    assert shares["mismatch/masked_frac"].item() == 0.0


@pytest.mark.parametrize(("options", "message"), [
    ({"mismatch_correction": "tis"}, "--algorithm.mismatch_correction 'tis': valid choices: none, token_truncate, "
                                     "token_mask, sequence_truncate, sequence_mask, geometric_mask"),
    ({"mismatch_correction": "token_mask", "mismatch_high": 0.5},
     "--algorithm.mismatch_high must be a finite number >= 1, got 0.5"),
    ({"mismatch_correction": "token_mask", "mismatch_low": 1.5}, "--algorithm.mismatch_low must be in [0, 1], got 1.5"),
    ({"mismatch_correction": "geometric_mask", "mismatch_low": 1.0, "mismatch_high": 1.0},
     "--algorithm.mismatch_low (1.0) must be below mismatch_high (1.0)"),
    ({"mismatch_high": 3.0}, "--algorithm.mismatch_low/mismatch_high need a --algorithm.mismatch_correction; valid: "
                             "token_truncate, token_mask, sequence_truncate, sequence_mask, geometric_mask"),
])
def test_bad_mismatch_options_are_one_line(options, message):
    with pytest.raises(ConfigError) as caught:
        PPO(**options)
    assert str(caught.value) == message


def test_the_mismatch_maximum_is_the_batch_maximum_through_the_backend(tmp_path):
    """Three rows in three micro-batches; one token of row 1 is 5 times likelier to the trainer than to the engine
    (masked by token_mask). The logged maximum is that token's |log-ratio| (a maximum over micro-batches, not
    their mean), and the masked share is that one token of the twelve."""
    model_dir = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(),
                            0, str(tmp_path / "model"))
    algorithm = GRPO(mismatch_correction="token_mask")
    backend = TorchBackend(lr=1e-2, micro_batch_size=1)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(model_dir), algorithm, embedded=True)
    batch = make_batch([1.0, 0.0, 0.4], [0, 0, 0], length=5)
    batch.input_ids = torch.randint(4, 60, batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    offsets = torch.tensor([[0.0, 0.01, 0.01, 0.01], [0.0, 0.02, math.log(5.0), 0.02], [0.0, 0.03, 0.03, 0.03]])
    batch.engine_logprobs = (backend.compute_logprobs(batch, "policy") - offsets) * batch.response_mask
    batch.advantages = algorithm.advantages(batch)
    metrics = backend.train(batch, set_up(algorithm, 4))
    assert metrics["mismatch/abs_log_ratio_max"] == pytest.approx(math.log(5.0), abs=1e-4)
    assert metrics["mismatch/masked_frac"] == pytest.approx(1 / 9)
    mean = (3 * 0.01 + 2 * 0.02 + math.log(5.0) + 3 * 0.03) / 9
    assert metrics["mismatch/abs_log_ratio_mean"] == pytest.approx(mean, abs=1e-4)


def test_a_run_with_a_correction_logs_the_mismatch_every_step():
    result = tiny_fit(steps=2, algorithm=GRPO(mismatch_correction="sequence_mask"))
    assert result.run_dir is not None
    with open(os.path.join(result.run_dir, "metrics.csv")) as f:
        rows = [row for row in csv.DictReader(f) if row.get("loss")]
    assert len(rows) == 2
    for row in rows:
        mean, top, masked = (float(row[f"mismatch/{k}"]) for k in ("abs_log_ratio_mean", "abs_log_ratio_max",
                                                                    "masked_frac"))
        # the hf engine in float32 and the trainer agree up to rounding: nothing is masked
        assert 0.0 <= mean <= top < 1e-3 and masked == 0.0
