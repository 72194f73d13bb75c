"""The arithmetic and compare tasks, held-out evaluation (``--trainer.eval_every``, ``gcore eval``) and GGUF errors."""

import csv
import json
import math

import pytest
from conftest import FAST, run_gcore_here

from gcore.data import DataConfig, load_eval_prompts, load_prompts
from gcore.errors import ConfigError, DataError
from gcore.evaluation import evaluate
from gcore.model import ModelConfig, char_tokenizer, load_tokenizer
from gcore.rewards.math import MathReward, final_answer
from gcore.tasks import ANSWER_FORMAT, arithmetic_rows, compare_rows, held_out
from gcore.trainer import Trainer, TrainerConfig
from gcore.types import Generation, SamplingParams


def _problem(row):
    """(a, op, b) of a row, read back from its text."""
    numbers = [int(w) for w in row["prompt"].replace("?", " ").replace(".", " ").split() if w.isdigit()]
    a, b = numbers
    op = "+" if int(row["answer"]) == a + b and a - b != int(row["answer"]) else "-"
    return a, op, b


def test_arithmetic_task_has_disjoint_deterministic_splits():
    train, test = arithmetic_rows(3000), arithmetic_rows(300, split="test")
    assert train == arithmetic_rows(3000)  # the same rows every time: no downloads, no randomness per run
    assert len({r["prompt"] for r in train}) == 3000
    train_problems, test_problems = {_problem(r) for r in train}, {_problem(r) for r in test}
    assert not train_problems & test_problems
    assert all(held_out(*p[::2], p[1]) for p in test_problems)
    for row in train[:200]:
        a, op, b = _problem(row)
        assert 10 <= a <= 999 and 10 <= b <= 999 and row["prompt"].endswith(ANSWER_FORMAT)
        assert int(row["answer"]) == (a + b if op == "+" else a - b) >= 0
    assert {op for _, op, _ in train_problems} == {"+", "-"}
    with pytest.raises(ValueError, match="split must be"):
        arithmetic_rows(1, split="dev")


def test_task_digits_sets_the_operand_sizes_and_keeps_the_splits_disjoint(tmp_path):
    easy, easy_test = arithmetic_rows(500, digits=(1, 2)), arithmetic_rows(50, split="test", digits=(1, 2))
    problems = [_problem(r) for r in easy]
    assert all(1 <= a <= 99 and 1 <= b <= 99 for a, _, b in problems)
    assert any(a < 10 for a, _, _ in problems) and any(a >= 10 for a, _, _ in problems)
    assert not set(problems) & {_problem(r) for r in easy_test}
    assert arithmetic_rows(5) == arithmetic_rows(5, digits=(2, 3))  # the default level is unchanged
    with pytest.raises(ValueError, match="fewer than 50 distinct problems"):
        arithmetic_rows(50, split="test", digits=(1, 1))  # 1-9 holds about a dozen held-out problems
    # through the data options, with a one-line error naming them
    tokenizer = char_tokenizer()
    config = DataConfig(task="arithmetic", task_digits=(1, 2), num_eval_prompts=4, num_synthetic_prompts=20)
    assert [p.answer for p in load_eval_prompts(config, tokenizer, 8, None)] == [r["answer"] for r in easy_test[:4]]
    with pytest.raises(DataError, match=r"--data.task_digits \[3, 1\]: digits must be"):
        load_prompts(DataConfig(task="arithmetic", task_digits=(3, 1)), tokenizer, 8, None)
    from gcore.cli import build_fit_parser, resolve_argv, with_default_plugins

    argv = with_default_plugins(resolve_argv(["--data.task", "arithmetic", "--data.task_digits", "[1,2]"]))
    assert build_fit_parser().parse_args(argv).data.task_digits == (1, 2)


def _pair(row):
    """(smaller, larger, "larger"|"smaller") of a compare row, read back from its text."""
    words = row["prompt"].replace("?", " ").replace(",", " ").split()
    a, b = (int(w) for w in words if w.isdigit())
    return min(a, b), max(a, b), words[3]


def test_compare_task_has_disjoint_deterministic_splits_and_balanced_answers():
    train, test = compare_rows(2000, digits=(2, 2)), compare_rows(100, split="test", digits=(2, 2))
    assert train == compare_rows(2000, digits=(2, 2)) and train != compare_rows(2000, seed=1, digits=(2, 2))
    pairs, test_pairs = [_pair(r) for r in train], {_pair(r) for r in test}
    assert not set(pairs) & test_pairs and all(held_out(*p) for p in test_pairs)
    for row, (low, high, which) in zip(train, pairs, strict=True):
        assert 10 <= low < high <= 99 and row["prompt"].endswith(ANSWER_FORMAT)
        assert row["answer"] == str(high if which == "larger" else low)
    # neither "the first number" nor "always the larger" answers more than about half
    first = sum(r["answer"] == str(next(int(w) for w in r["prompt"].replace(",", " ").split() if w.isdigit()))
                for r in train)
    larger = sum(which == "larger" for _, _, which in pairs)
    assert 0.45 < first / len(train) < 0.55 and 0.45 < larger / len(train) < 0.55
    with pytest.raises(ValueError, match="fewer than 50 distinct questions"):
        compare_rows(50, split="test", digits=(1, 1))
    tokenizer = char_tokenizer()
    config = DataConfig(task="compare", task_digits=(2, 2), num_eval_prompts=4, num_synthetic_prompts=20)
    assert [p.answer for p in load_eval_prompts(config, tokenizer, 8, None)] == [r["answer"] for r in test[:4]]
    assert load_prompts(config, tokenizer, 8, None)[0].source == "<compare:train>:1"


def test_the_math_reward_scores_the_compare_task():
    reward, row = MathReward(), compare_rows(1, digits=(2, 2))[0]
    low, high, _ = _pair(row)
    other = str(high if row["answer"] == str(low) else low)
    from gcore.testing import make_sample

    replies = {f"The answer is {row['answer']}.": 1.0,
               f"{high} is larger than {low}. The answer is {row['answer']}.": 1.0, f"The answer is {other}.": 0.0,
               row["answer"]: 0.0}  # the bare number lacks the asked-for sentence
    samples = [make_sample(row["prompt"], text, row["answer"]) for text in replies]
    assert reward.score(samples) == list(replies.values())


def test_the_math_reward_credits_the_models_own_answer_styles():
    """Reply styles of SmolLM2-135M-Instruct on the task (BENCHMARKS.md), each scored by its final "answer is"."""
    reward = MathReward()
    from gcore.testing import make_sample

    replies = {"The answer is 4.": 1.0, "The answer is 4. The answer is 4.": 1.0, "The answer is 4": 1.0,
               "5 - 1 = 4\nThe answer is 4.": 1.0, "The answer is: 4.": 1.0, "The answer is $4$.": 1.0,
               "The answer is 4.\n\nThis is a classic example of a logical fallacy.": 1.0,
               "N = 4\nThe answer is N.": 0.0, "The answer is 5.": 0.0, "5 - 1 = 4, so 4 are left.": 0.0}
    samples = [make_sample("A train carries 5 passengers. At the station 1 get off.", text, "4") for text in replies]
    assert reward.score(samples) == list(replies.values())


def test_the_math_reward_scores_the_tasks_answer_format():
    reward, row = MathReward(), arithmetic_rows(1)[0]
    from gcore.testing import make_sample

    right = make_sample(row["prompt"], f"First, compute. The answer is {row['answer']}.", row["answer"])
    wrong = make_sample(row["prompt"], f"The answer is {int(row['answer']) + 1}.", row["answer"])
    assert final_answer(right.response_text) == row["answer"]
    assert reward.score([right, wrong]) == [1.0, 0.0]


def test_eval_prompts_come_from_the_held_out_split_or_a_file(tmp_path):
    tokenizer = char_tokenizer()
    config = DataConfig(task="arithmetic", num_eval_prompts=5, num_synthetic_prompts=50)
    train = load_prompts(config, tokenizer, 8, None)
    held = load_eval_prompts(config, tokenizer, 8, None)
    assert len(train) == 50 and len(held) == 5 and held[0].source == "<arithmetic:test>:1"
    assert not {p.text for p in train} & {p.text for p in held}
    (tmp_path / "eval.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    with_file = DataConfig(path="x.jsonl", eval_path=str(tmp_path / "eval.jsonl"))
    from_file = load_eval_prompts(with_file, tokenizer, 8, None)
    assert [p.answer for p in from_file] == ["2", "4"]
    with pytest.raises(DataError, match="set --data.eval_path"):
        load_eval_prompts(DataConfig(path="x.jsonl"), tokenizer, 8, None)
    with pytest.raises(DataError, match="--data.task 'nope': valid choices: target_char, arithmetic, compare"):
        load_prompts(DataConfig(task="nope"), tokenizer, 8, None)


class _ScriptedEngine:
    """Answers each prompt with a fixed text: greedy right, sampled wrong (records the temperatures)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.temperatures = tokenizer, []

    def generate(self, prompts, params):
        self.temperatures.append(params.temperature)
        text = "The answer is 2." if params.temperature == 0 else "The answer is 3."
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [[Generation(ids, [0.0] * len(ids), True)] for _ in prompts]


def test_evaluate_reports_greedy_and_sampled_accuracy():
    tokenizer = char_tokenizer()
    prompts = load_eval_prompts(DataConfig(task="arithmetic", num_eval_prompts=3), tokenizer, 8, None)
    for p in prompts:
        p.answer = "2"
    engine = _ScriptedEngine(tokenizer)
    metrics = evaluate(engine, MathReward(), tokenizer, prompts, SamplingParams(temperature=0.7))
    assert engine.temperatures == [0.0, 0.7]
    assert metrics["eval/accuracy_greedy"] == 1.0 and metrics["eval/accuracy_sampled"] == 0.0
    assert metrics["eval/prompts"] == 3


@pytest.mark.integration
def test_eval_every_logs_held_out_accuracy_and_report_plots_it(tmp_path):
    root = tmp_path / "runs"
    # gcore fit and gcore report through the CLI's main, in this process (a fresh one would only import gcore again)
    result = run_gcore_here("fit", *FAST, "--trainer.max_steps", "3", "--trainer.eval_every", "2",
                       "--data.num_eval_prompts", "4", "--trainer.default_root_dir", str(root), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = next(root.glob("*/version_0"))
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evaluated = [int(float(r["step"])) for r in rows if r.get("eval/accuracy_greedy")]
    assert evaluated == [0, 2, 3]  # before the first step, every 2 steps, after the last
    trained = [int(float(r["step"])) for r in rows if r.get("reward/mean")]
    assert trained == [0, 1, 2]  # each evaluation has a row of its own, logged when it is done
    for r in rows:
        if r.get("eval/accuracy_greedy"):
            assert 0 <= float(r["eval/accuracy_greedy"]) <= 1 and float(r["eval/prompts"]) == 4
    pytest.importorskip("matplotlib")
    report = run_gcore_here("report", str(run))
    assert report.returncode == 0, report.stderr
    assert "steps: 3" in report.stdout and "eval/accuracy_greedy:" in report.stdout
    assert "(3 evaluations)" in report.stdout
    assert (run / "plots" / "eval_accuracy.png").is_file()


@pytest.mark.integration
def test_gcore_eval_prints_the_metrics(tmp_path):
    result = run_gcore_here("eval", "--model.num_hidden_layers", "1", "--model.hidden_size", "32",
                       "--model.intermediate_size", "64", "--sampling.max_new_tokens", "4",
                       "--data.num_eval_prompts", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout[result.stdout.index("{"):])
    assert metrics["eval/prompts"] == 3 and math.isfinite(metrics["eval/accuracy_sampled"])


@pytest.mark.integration
def test_gguf_paths_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="no such GGUF file"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "missing.gguf")))
    result = run_gcore_here("import", str(tmp_path / "model.bin"), str(tmp_path / "out"))
    assert result.returncode == 2 and "expected a .gguf file" in result.stderr


def test_evaluation_under_one_controller_is_refused_when_the_trainer_is_built():
    # one line, before any process or engine is launched
    with pytest.raises(ConfigError, match=r"--trainer.eval_every runs with one controller per process"):
        Trainer(trainer=TrainerConfig(devices=2, controllers=1, eval_every=1))

