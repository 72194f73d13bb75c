"""A run whose every group ties step after step says so in one line while it runs (issue 52)."""

from __future__ import annotations

import pytest

from gcore.algorithms.stall import StallWatch, trained_nothing
from gcore.rewards.base import RuleReward
from gcore.testing import tiny_fit


class Tied(RuleReward):
    """Every sample scores the same: every group ties, every advantage is 0."""

    def score_one(self, sample):
        return 0.1


class Varied(RuleReward):
    def score_one(self, sample):
        return float(sum(sample.response_ids) % 3)


def test_a_run_of_tied_groups_prints_one_line(capsys):
    result = tiny_fit(steps=5, reward=Tied())
    assert all(trained_nothing(m) for m in result.history)  # the scripted run trained nothing, step after step
    lines = [line for line in capsys.readouterr().err.splitlines() if "no sample trained" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("gcore: step 3: no sample trained for 4 steps in a row")
    assert "mean reply length" in lines[0] and "tokens over those steps" in lines[0]


def test_a_run_that_trains_prints_nothing(capsys):
    result = tiny_fit(steps=4, reward=Varied())
    assert not any(trained_nothing(m) for m in result.history)
    assert "no sample trained" not in capsys.readouterr().err


def test_the_count_starts_again_after_a_trained_step_and_reports_the_length_trend():
    watch = StallWatch(after=3)
    idle = lambda length: {"trained_rows_frac": 0.0, "grad_norm": 0.0, "response_length/mean": length}  # noqa: E731
    busy = {"trained_rows_frac": 0.5, "grad_norm": 2.0, "response_length/mean": 20.0}
    assert [watch.update(s, m) for s, m in enumerate([idle(22), idle(10), busy, idle(9), idle(5)])] == [None] * 5
    line = watch.update(5, idle(3))
    assert line == ("gcore: step 5: no sample trained for 3 steps in a row (every group's rewards tied, so every "
                    "advantage was 0); mean reply length 9.0 -> 3.0 tokens over those steps")
    assert watch.update(6, idle(2)) is None  # once per stretch
    # --backend.skip_inert_rows false runs every row: a zero gradient still means nothing trained
    assert trained_nothing({"trained_rows_frac": 1.0, "grad_norm": 0.0})
    assert not trained_nothing({"trained_rows_frac": 1.0, "grad_norm": 0.3})
    with pytest.raises(ValueError, match="after must be >= 1"):
        StallWatch(after=0)
