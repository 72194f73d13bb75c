"""The real-model suite's embedded tasks (issue 36): disjoint splits, right answers, scored 1 by the math reward."""

import re

import pytest
import torch

from gcore.data import DataConfig, load_eval_prompts, load_prompts
from gcore.model import char_tokenizer
from gcore.rewards.math import MathReward
from gcore.tasks import TASKS, held_out
from gcore.types import Prompt, Sample

SUITE_TASKS = {"count_letter": (1, 1), "middle": (2, 2), "multiply": (1, 2), "count_even": (2, 2),
               "digit_sum": (2, 3)}


def _numbers(prompt: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", prompt.split("?")[0])]


def solve(task: str, prompt: str) -> str:
    """The answer worked out again from the prompt's text alone, a second way."""
    if task == "count_letter":
        letter = re.search(r"the letter '(\w)'", prompt).group(1)
        spelled = re.search(r"is spelled ([\w-]+)\.", prompt).group(1).split("-")
        return str(spelled.count(letter))
    if task == "middle":
        return str(sorted(_numbers(prompt))[1])
    if task == "multiply":
        a, b = _numbers(prompt)
        return str(a * b)
    if task == "count_even":
        return str(len([n for n in _numbers(prompt) if n % 2 == 0]))
    if task == "digit_sum":
        (n,) = _numbers(prompt)
        return str(sum(map(int, str(n))))
    raise AssertionError(task)


@pytest.mark.parametrize("task", SUITE_TASKS)
def test_splits_are_disjoint_and_answers_right(task):
    digits = SUITE_TASKS[task]
    train, test = TASKS[task](300, 0, "train", digits), TASKS[task](30, 0, "test", digits)
    assert len(train) == 300 and len(test) == 30
    assert len({r["prompt"] for r in train}) == 300  # distinct problems
    # disjoint by what defines the problem, not only the wording: the sets of numbers (or word and letter)
    key = (lambda r: r["prompt"]) if task == "count_letter" else (lambda r: tuple(sorted(_numbers(r["prompt"]))))
    assert not {key(r) for r in train} & {key(r) for r in test}
    for row in train[:50] + test:
        assert row["answer"] == solve(task, row["prompt"]), row
    assert TASKS[task](30, 0, "test", digits) == test  # stable


def test_hand_checked_rows():
    """A few rows worked out by hand."""
    rows = TASKS["count_letter"](200, 0, "train", (1, 1))
    strawberry = [r for r in rows if "'strawberry'" in r["prompt"] and "letter 'r'" in r["prompt"]]
    assert all(r["answer"] == "3" for r in strawberry)
    row = TASKS["middle"](1, 0, "test", (2, 3))[0]
    assert row["prompt"].startswith("Sort the numbers 207, 747 and 940 from smallest to largest.")
    assert row["answer"] == "747"
    for row in TASKS["count_even"](5, 0, "test", (2, 2)):
        assert row["answer"] == str(sum(n % 2 == 0 for n in _numbers(row["prompt"])))
    row = TASKS["digit_sum"](1, 0, "test", (2, 3))[0]
    n = _numbers(row["prompt"])[0]
    assert row["answer"] == str(n // 100 + n // 10 % 10 + n % 10)
    assert "\\boxed{}" in row["prompt"]


def test_held_out_decides_by_the_problem():
    for row in TASKS["multiply"](20, 0, "test", (1, 2)):
        a, b = sorted(_numbers(row["prompt"]))  # the operands in either order
        assert held_out(a, b, "*")
    for row in TASKS["multiply"](200, 0, "train", (1, 2)):
        a, b = sorted(_numbers(row["prompt"]))
        assert not held_out(a, b, "*")


@pytest.mark.parametrize("task", SUITE_TASKS)
def test_math_reward_scores_the_answer(task):
    reward = MathReward()
    reward.setup(torch.device("cpu"))
    row = TASKS[task](1, 0, "test", SUITE_TASKS[task])[0]
    prompt = Prompt(0, row["prompt"], [1], answer=row["answer"])
    wrong = str(int(row["answer"]) + 1)
    replies = [f"Let me think. The answer is {row['answer']}.", f"\\boxed{{{row['answer']}}}",
               f"The answer is {wrong}.", "I do not know."]
    samples = [Sample(prompt, 0, [3], [-1.0], text, True) for text in replies]
    assert reward.score(samples) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("task", SUITE_TASKS)
def test_data_config_loads_the_task(task):
    config = DataConfig(task=task, task_digits=SUITE_TASKS[task], num_synthetic_prompts=8, num_eval_prompts=4)
    tokenizer = char_tokenizer()
    train = load_prompts(config, tokenizer, 16, None)
    test = load_eval_prompts(config, tokenizer, 16, None)
    assert len(train) == 8 and len(test) == 4
    assert not {p.text for p in train} & {p.text for p in test}
