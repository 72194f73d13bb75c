"""The real-model task suite of issue 36: tasks of families gcore was not tuned on, and a probe of a model on them.

The suite is a list of embedded tasks (``gcore.tasks.TASKS``), each at one level (``--data.task_digits``), each
with a held-out split (``gcore.tasks.held_out``) and scored by the ``math`` reward. ``benchmarks/vs_trl.py --tasks
suite`` (or ``--tasks first``, ``--tasks second``) trains gcore and TRL side by side over them.

``--probe`` measures the untrained model's greedy accuracy on the first ``--problems`` held-out problems of each
task (the ``hf`` engine, temperature 0, the tokenizer's chat template), so that every task is one the model answers
sometimes, not never and not always (GRPO learns nothing from groups that all score the same):

    python benchmarks/task_suite.py --probe --model-path /tmp/smollm2-hf --problems 32
"""

from __future__ import annotations

import argparse
import statistics
import time

#: each task of the suite and its level (``--data.task_digits``; ``count_letter`` ignores it). The untrained
#: SmolLM2-135M-Instruct's greedy accuracy on the first 32 held-out problems (``--probe``, 48 new tokens, 2026-11-26,
#: the 2-core CPU): count_letter 0/32, middle 11/32, multiply 1/32, count_even 1/32, digit_sum 0/32 (its replies
#: do the sum, mostly wrongly, and never box it), compare 8/32
SUITE_LEVELS: dict[str, tuple[int, int]] = {
    "count_letter": (1, 1),
    "middle": (2, 2),
    "multiply": (1, 2),
    "count_even": (2, 2),
    "digit_sum": (2, 3),
    "compare": (1, 2),
    # issue 52's shape, outside both halves: "What is N + 1? Answer with the number only." (4 digits), its own reward
    # (gcore.tasks.number_only_reward: 1 right, 0.1 a wrong short number); benchmarks/results/parity.md
    "number_only": (4, 4),
}

#: The suite's halves. Defaults (learning rate, loss aggregation, KL, clip, advantage epsilon, ...) may be chosen
#: by looking at the FIRST half only; the figures reported for gcore against TRL (BENCHMARKS.md, the README's
#: headline) come from the SECOND half only, on which no default was tuned. Keep the split fixed: moving a task
#: between the halves after seeing its results would defeat it. The second half holds the three families the
#: untrained model answers sometimes (ordering, multiplication, parity; the probe above); the first half the
#: string task and the format-constrained one, which it never answered greedily (GRPO learns there only from rare
#: right samples), and compare, the family gcore was built with.
SUITE_HALVES: dict[str, tuple[str, ...]] = {
    "first": ("count_letter", "digit_sum", "compare"),
    "second": ("middle", "multiply", "count_even"),
}
SUITE: tuple[str, ...] = SUITE_HALVES["first"] + SUITE_HALVES["second"]


def resolve_tasks(spec: str) -> list[str]:
    """``--tasks``: comma-separated task names, where ``suite``, ``first`` and ``second`` stand for the whole suite
    and its halves."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        names.extend(SUITE if part == "suite" else SUITE_HALVES.get(part, (part,)))
    return list(dict.fromkeys(names))


def level(task: str, override: str | None = None) -> tuple[int, int]:
    """A task's level: ``override`` (``"fewest,most"``) when given, else the suite's, else ``(2, 3)``."""
    if override:
        fewest, most = (int(x) for x in override.split(","))
        return fewest, most
    return SUITE_LEVELS.get(task, (2, 3))


def probe(model_path: str, tasks: list[str], problems: int, max_new_tokens: int, show: int) -> dict[str, float]:
    """Greedy accuracy of the untrained model on the first ``problems`` held-out problems of each task."""
    import torch

    from gcore.data import DataConfig, load_eval_prompts
    from gcore.engines.hf import HFEngine
    from gcore.model import ModelConfig, ModelSource, load_tokenizer
    from gcore.rewards.math import MathReward
    from gcore.types import Sample, SamplingParams

    tokenizer = load_tokenizer(ModelConfig(path=model_path))
    engine = HFEngine()
    engine.setup(ModelSource(model_path), torch.device("cpu"))
    reward = MathReward()
    reward.setup(torch.device("cpu"))
    sampling = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                              stop_token_ids=(tokenizer.eos_token_id,))
    accuracy: dict[str, float] = {}
    try:
        for task in tasks:
            start = time.perf_counter()
            data = DataConfig(task=task, chat_template=True, task_digits=level(task),  # type: ignore[arg-type]
                              num_eval_prompts=problems)
            prompts = load_eval_prompts(data, tokenizer, max_new_tokens, None)
            outputs = engine.generate([p.token_ids for p in prompts], sampling)
            samples = [Sample(prompt=p, group=i, response_ids=g[0].token_ids, response_logprobs=g[0].logprobs,
                              response_text=tokenizer.decode(g[0].token_ids, skip_special_tokens=True),
                              finished=g[0].finished) for i, (p, g) in enumerate(zip(prompts, outputs, strict=True))]
            scores = reward.score(samples)
            accuracy[task] = statistics.mean(scores)
            lengths = [len(s.response_ids) for s in samples]
            print(f"{task:13s} level {level(task)}: greedy accuracy {accuracy[task]:.3f} "
                  f"({int(sum(scores))}/{len(scores)}), mean reply {statistics.mean(lengths):.1f} tokens, "
                  f"{sum(s.finished for s in samples)}/{len(samples)} ended by EOS, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
            for s, score in list(zip(samples, scores, strict=True))[:show]:
                print(f"    [{score:.0f}] answer {s.prompt.answer}: {s.response_text[-120:]!r}")
    finally:
        engine.shutdown()
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", action="store_true", help="measure the untrained model's greedy accuracy")
    parser.add_argument("--model-path", default="/tmp/smollm2-hf", help="an HF checkpoint folder")
    parser.add_argument("--tasks", default="suite", help="comma-separated tasks; suite, first, second: the halves")
    parser.add_argument("--problems", type=int, default=32, help="held-out problems per task")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--show", type=int, default=2, help="replies printed per task")
    args = parser.parse_args()
    if not args.probe:
        print(f"suite: first half {', '.join(SUITE_HALVES['first'])}; second half {', '.join(SUITE_HALVES['second'])}")
        for task in SUITE:
            print(f"  {task}: level {SUITE_LEVELS[task]}")
        return
    probe(args.model_path, resolve_tasks(args.tasks), args.problems, args.max_new_tokens, args.show)


if __name__ == "__main__":
    main()
