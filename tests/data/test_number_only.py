"""The ``number_only`` task of issue 52 and its partial-credit reward."""

from __future__ import annotations

import pytest

from gcore.tasks import NUMBER_ONLY_PARTIAL, TASKS, held_out, number_only_reward


def test_the_splits_are_disjoint_stable_and_answered_by_n_plus_one():
    train, test = TASKS["number_only"](300, 0, "train", (4, 4)), TASKS["number_only"](30, 0, "test", (4, 4))
    numbers = lambda rows: {int(r["prompt"].split()[2]) for r in rows}  # noqa: E731  "What is N + 1? ..."
    assert not numbers(train) & numbers(test) and len(numbers(train)) == 300
    assert all(held_out(n, 1, "+") for n in numbers(test)) and not any(held_out(n, 1, "+") for n in numbers(train))
    for row in test:
        n = int(row["prompt"].split()[2])
        assert 1000 <= n <= 9999 and row["answer"] == str(n + 1)
        assert row["prompt"] == f"What is {n} + 1? Answer with the number only."
    assert TASKS["number_only"](30, 0, "test", (4, 4)) == test


@pytest.mark.parametrize(("reply", "score"), [
    ("3078", 1.0), ("3078.", 1.0), ("3077 + 1 equals 3078.", 1.0), ("3,078", 1.0),
    ("3079", NUMBER_ONLY_PARTIAL), (" 3079. ", NUMBER_ONLY_PARTIAL),
    ("3077 + 1 = 3077 + 1 = 30", 0.0),  # a chain cut at the token limit
    ("The answer is 3079 because", 0.0), ("no idea", 0.0), ("", 0.0),
])
def test_the_reward_credits_the_right_number_and_a_short_wrong_one(reply, score):
    assert number_only_reward(reply, "3078") == score
