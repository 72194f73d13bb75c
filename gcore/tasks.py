"""The embedded tasks, generated (no downloads): ``target_char``, the default, which a randomly
initialised model can learn; ``arithmetic``, word problems for a small pretrained instruct model;
``compare``, which of two numbers is larger, a level a 135M-parameter instruct model answers about half
the time (BENCHMARKS.md), so GRPO's groups hold both right and wrong answers from the first step;
``count_letter``, ``middle``, ``multiply``, ``count_even`` and ``digit_sum``, the real-model suite's tasks of
other families (``benchmarks/task_suite.py``);
``mixed``, compare questions mixed with open-ended prompts for a generative judge, whose share changes
along the dataset (for the ``routed`` reward); ``reveal``, the multi-turn task of ``--env reveal``;
``shape_colour``, the visual task: the colour of a shape drawn on a small canvas (docs/multimodal.md)."""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable
from typing import Literal


def target_char_rows(num_prompts: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompts such as ``"7=" `` whose answer is the digit to repeat.

    With the ``target_char`` reward, a response scores the share of its characters that equal the
    digit. A random model hits it about once in a hundred characters; a trained one repeats it.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        digit = str(rng.randrange(10))
        rows.append({"prompt": f"{digit}=", "answer": digit})
    return rows


def reveal_rows(num_prompts: int, seed: int = 0) -> list[dict[str, str]]:
    """The multi-turn task of ``--env reveal``: the prompt ``?=`` hides the digit (the answer), which the
    environment reveals after the model's first turn; the second turn is scored as ``target_char``."""
    return [{"prompt": "?=", "answer": row["answer"]} for row in target_char_rows(num_prompts, seed)]


#: (question, operation) templates of the arithmetic task; ``{a}`` and ``{b}`` are the operands
_WORD_PROBLEMS: list[tuple[str, str]] = [
    ("{name} has {a} marbles and finds {b} more. How many marbles does {name} have now?", "+"),
    ("A library owns {a} books and buys {b} new ones. How many books does it own now?", "+"),
    ("A farm has {a} sheep. {b} lambs are born. How many sheep are on the farm now?", "+"),
    ("{name} walked {a} metres in the morning and {b} metres in the afternoon. How many metres in all?", "+"),
    ("A shop had {a} apples and sold {b} of them. How many apples are left?", "-"),
    ("{name} had {a} stickers and gave {b} to a friend. How many stickers does {name} have left?", "-"),
    ("A tank holds {a} litres of water. {b} litres are drained. How many litres remain?", "-"),
    ("A train carries {a} passengers. At the station {b} get off. How many passengers are still on the train?", "-"),
]
_NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Ivy", "Max", "Zoe"]
#: appended to every question: the ``math`` reward reads the number after "The answer is"
ANSWER_FORMAT = "End your reply with 'The answer is N.' where N is the number."


def held_out(a: int, b: int, op: str) -> bool:
    """Whether the problem ``a op b`` belongs to the held-out split (about one problem in ten)."""
    return zlib.crc32(f"{a}{op}{b}".encode()) % 10 == 0


def arithmetic_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                    digits: tuple[int, int] = (2, 3)) -> list[dict[str, str]]:
    """Word problems adding or subtracting two numbers; the answer is the resulting number.

    ``digits`` is the operands' size in digits, ``(fewest, most)``: ``(2, 3)`` (the default) draws
    10-999, ``(1, 2)`` draws 1-99, an easier level for small models.

    ``split="test"`` draws only held-out problems and ``"train"`` never does (``held_out`` decides
    by the operands and the operation, whatever the wording), so accuracy on the test split measures
    arithmetic the policy did not train on. Subtractions never go below zero. Score with the ``math``
    reward: the prompt asks for a final "The answer is N.".
    """
    def propose(rng: random.Random, low: int, high: int) -> _Proposal:
        template, op = rng.choice(_WORD_PROBLEMS)
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        if op == "-" and b > a:
            a, b = b, a
        answer = str(a + b if op == "+" else a - b)
        return (a, b, op), (a, b, op), lambda: {
            "prompt": f"{template.format(name=rng.choice(_NAMES), a=a, b=b)} {ANSWER_FORMAT}", "answer": answer}

    suffix = "" if digits == (2, 3) else f"-{digits[0]}-{digits[1]}"
    return _distinct_rows(num_prompts, split, digits, f"arithmetic-{split}-{seed}{suffix}", "problems", "problems",
                          propose)


def compare_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                 digits: tuple[int, int] = (2, 3)) -> list[dict[str, str]]:
    """"Which number is larger, A or B?" (or smaller); the answer is that number.

    ``digits`` is the numbers' size in digits, ``(fewest, most)``, as in ``arithmetic_rows``. The two
    numbers differ; which one comes first and whether the larger or the smaller is asked for are drawn
    at random, so answering with the first (or last) number, or always the larger, scores about half.
    ``split="test"`` draws only held-out pairs and ``"train"`` never does (``held_out`` on the pair and
    the question, whatever their order). Score with the ``math`` reward: the prompt asks for a final
    "The answer is N.".
    """
    def propose(rng: random.Random, low: int, high: int) -> _Proposal | None:
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        which = rng.choice(["larger", "smaller"])
        if a == b:
            return None
        answer = str(max(a, b) if which == "larger" else min(a, b))
        return (a, b, which), (min(a, b), max(a, b), which), lambda: {
            "prompt": f"Which number is {which}, {a} or {b}? {ANSWER_FORMAT}", "answer": answer}

    return _distinct_rows(num_prompts, split, digits, f"compare-{split}-{seed}-{digits[0]}-{digits[1]}", "pairs",
                          "questions", propose)


#: the open-ended prompts of the ``mixed`` task; ``{n}`` is a number
_OPEN_ENDED = ["Write one sentence about the number {n}.", "Describe the number {n} in one sentence.",
               "Give one fact about the number {n} in a single sentence."]


def judged_shares(num_prompts: int, judged_share: tuple[float, float]) -> list[bool]:
    """Which of ``num_prompts`` prompts are judged, the share going linearly from ``judged_share[0]`` (the
    first prompt) to ``judged_share[1]`` (the last): prompt ``i`` is judged when the running sum of the
    shares passes a whole number there, so every stretch of the order holds its share, rounded."""
    start, end = judged_share
    if not (0 <= start <= 1 and 0 <= end <= 1):
        raise ValueError(f"judged_share must be [start, end] within [0, 1], got {list(judged_share)}")
    judged, total = [], 0.0
    for i in range(num_prompts):
        share = start + (end - start) * (i / (num_prompts - 1) if num_prompts > 1 else 0.0)
        judged.append(int(total + share + 1e-9) > int(total + 1e-9))
        total += share
    return judged


def mixed_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
               digits: tuple[int, int] = (2, 3),
               judged_share: tuple[float, float] = (0.1, 0.9)) -> list[dict[str, str]]:
    """``compare`` questions (``reward: "math"``, with an answer) mixed with open-ended prompts such as
    "Write one sentence about the number N." (``reward: "judge"``, no answer: a generative judge decides).

    The judged share goes linearly from ``judged_share[0]`` at the first row to ``judged_share[1]`` at the
    last (``judged_shares``); the compare rows are ``compare_rows(..., seed, split, digits)`` in their order,
    and the open-ended numbers of ``split="test"`` are those that ``held_out`` holds out. Score with the
    ``routed`` reward, routing by the ``reward`` column.
    """
    judged = judged_shares(num_prompts, judged_share)
    compare = iter(compare_rows(num_prompts - sum(judged), seed, split, digits))
    rng = random.Random(f"mixed-{split}-{seed}-{digits[0]}-{digits[1]}")
    low, high = 10 ** (digits[0] - 1), 10 ** digits[1]
    rows = []
    for is_judged in judged:
        if not is_judged:
            rows.append({**next(compare), "reward": "math"})
            continue
        for _ in range(1000):
            n = rng.randrange(low, high)
            if held_out(n, 0, "write") == (split == "test"):
                break
        else:
            raise ValueError(f"the {split} split of {digits[0]}-{digits[1]} digit numbers has none to write about; "
                             "use more digits")
        rows.append({"prompt": rng.choice(_OPEN_ENDED).format(n=n), "reward": "judge"})
    return rows


# ----------------------------------------------------------------------------------------------------------- #
# the real-model suite's task families (benchmarks/vs_trl.py --tasks): each scored by the ``math`` reward,     #
# each split by ``held_out`` on what defines the problem, never on its wording                                  #
# ----------------------------------------------------------------------------------------------------------- #

#: the words of the ``count_letter`` task: common English words of 4-10 letters, many with a repeated letter
_WORDS = (
    "apple banana cherry letter little coffee butter bottle pepper summer winter dinner rabbit parrot carrot "
    "yellow window pillow follow hollow balloon kitten mitten puppy happy sunny funny bubble puzzle middle "
    "paddle saddle riddle cookie rocket pocket ticket basket garden market planet silver mirror pebble "
    "needle noodle marble purple circle giraffe elephant mountain blossom cabbage address success tomorrow "
    "committee bookkeeper mississippi papaya pizza jazz llama dolphin tiger zebra monkey turtle "
    "teacher student library freedom cassette tattoo coconut avocado potato tomato lemonade strawberry "
    "raspberry blueberry pineapple grapefruit umbrella computer keyboard letterbox football baseball "
    "sweetness goodness darkness happiness kindness seventeen eighteen thirteen fourteen bookshelf "
    "classroom afternoon sunflower snowball waterfall rainbow mushroom cheese breeze sneeze cotton button "
    "lantern village harbour battery gallery pepperoni spaghetti broccoli vanilla chocolate"
).split()
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def count_letter_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                      digits: tuple[int, int] = (2, 3)) -> list[dict[str, str]]:
    """String manipulation: "The word 'strawberry' is spelled s-t-r-a-w-b-e-r-r-y. How many times does the letter
    'r' appear in it?"; the answer is
    the count (0 when the letter is absent, about one question in six). ``digits`` is ignored (the words are a
    fixed list). ``held_out`` decides by the word and the letter. Score with the ``math`` reward."""
    del digits

    def propose(rng: random.Random, low: int, high: int) -> _Proposal:
        index = rng.randrange(len(_WORDS))
        word = _WORDS[index]
        letter = rng.choice(_LETTERS) if rng.random() < 1 / 6 else rng.choice(word)
        key = (index, ord(letter), "count")
        return key, key, lambda: {
            "prompt": f"The word '{word}' is spelled {'-'.join(word)}. How many times does the letter '{letter}' "
                      f"appear in it? {ANSWER_FORMAT}",
            "answer": str(word.count(letter))}

    return _distinct_rows(num_prompts, split, (1, 1), f"count_letter-{split}-{seed}", "words", "questions", propose)


def middle_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                digits: tuple[int, int] = (2, 3)) -> list[dict[str, str]]:
    """Ordering: "Sort the numbers A, B and C from smallest to largest. Which number is in the middle?"; the answer
    is the median of three distinct numbers of ``digits`` (fewest, most) digits, listed in random order.
    ``held_out`` decides by the set of numbers, whatever their order. Score with the ``math`` reward."""
    def propose(rng: random.Random, low: int, high: int) -> _Proposal | None:
        numbers = [rng.randrange(low, high) for _ in range(3)]
        if len(set(numbers)) < 3:
            return None
        small, mid, large = sorted(numbers)
        a, b, c = numbers
        key = (small, large, f"middle{mid}")
        return key, key, lambda: {
            "prompt": f"Sort the numbers {a}, {b} and {c} from smallest to largest. Which number is in the middle? "
                      f"{ANSWER_FORMAT}",
            "answer": str(mid)}

    return _distinct_rows(num_prompts, split, digits, f"middle-{split}-{seed}-{digits[0]}-{digits[1]}", "triples",
                          "sets", propose)


def multiply_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                  digits: tuple[int, int] = (2, 3)) -> list[dict[str, str]]:
    """Arithmetic of another family than ``arithmetic``'s: "What is A times D?", A of ``digits`` (fewest, most)
    digits, D a single digit 2-9, the operands' order drawn. ``held_out`` decides by the pair, smaller first. Score
    with the ``math`` reward."""
    def propose(rng: random.Random, low: int, high: int) -> _Proposal:
        a, d = rng.randrange(low, high), rng.randrange(2, 10)
        first, second = (a, d) if rng.random() < 0.5 else (d, a)
        key = (min(a, d), max(a, d), "*")  # 7 x 5 and 5 x 7 are one problem
        return key, key, lambda: {"prompt": f"What is {first} times {second}? {ANSWER_FORMAT}", "answer": str(a * d)}

    return _distinct_rows(num_prompts, split, digits, f"multiply-{split}-{seed}-{digits[0]}-{digits[1]}", "pairs",
                          "products", propose)


def count_even_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                    digits: tuple[int, int] = (2, 3)) -> list[dict[str, str]]:
    """Parity: "How many of these numbers are even: A, B, C, D?"; the answer is the count, 0-4, of four distinct
    numbers of ``digits`` (fewest, most) digits. ``held_out`` decides by the set of numbers. Score with the
    ``math`` reward."""
    def propose(rng: random.Random, low: int, high: int) -> _Proposal | None:
        numbers = [rng.randrange(low, high) for _ in range(4)]
        if len(set(numbers)) < 4:
            return None
        key = (0, 0, "even" + ",".join(map(str, sorted(numbers))))
        return key, key, lambda: {
            "prompt": f"How many of these numbers are even: {', '.join(map(str, numbers))}? {ANSWER_FORMAT}",
            "answer": str(sum(n % 2 == 0 for n in numbers))}

    return _distinct_rows(num_prompts, split, digits, f"count_even-{split}-{seed}-{digits[0]}-{digits[1]}",
                          "numbers", "sets", propose)


#: the ``digit_sum`` task's required answer format: a LaTeX box (the ``math`` reward reads the last one first)
BOXED_FORMAT = "Write only the final number inside \\boxed{}, for example \\boxed{7}."


def digit_sum_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                   digits: tuple[int, int] = (2, 3)) -> list[dict[str, str]]:
    """A format-constrained answer: "What is the sum of the digits of N? Write only the final number inside
    \\boxed{}..."; N has ``digits`` (fewest, most) digits. ``held_out`` decides by N. Score with the ``math``
    reward, which reads the last ``\\boxed{}`` (a reply without one and without "The answer is" scores 0)."""
    def propose(rng: random.Random, low: int, high: int) -> _Proposal:
        n = rng.randrange(low, high)
        key = (n, 0, "digitsum")
        return key, key, lambda: {"prompt": f"What is the sum of the digits of {n}? {BOXED_FORMAT}",
                                  "answer": str(sum(int(ch) for ch in str(n)))}

    return _distinct_rows(num_prompts, split, digits, f"digit_sum-{split}-{seed}-{digits[0]}-{digits[1]}", "numbers",
                          "numbers", propose)


#: a proposed problem: (its key, unique in a split; what ``held_out`` decides by; the row, made once accepted)
_Proposal = tuple[tuple[int, int, str], tuple[int, int, str], Callable[[], dict]]


def _distinct_rows(num_prompts: int, split: str, digits: tuple[int, int], rng_seed: str, drawn: str, unit: str,
                   propose: Callable[[random.Random, int, int], _Proposal | None]) -> list[dict]:
    """``num_prompts`` distinct problems of ``split`` with numbers of ``digits`` (fewest, most) digits, from
    ``propose(rng, low, high)`` (``None``: rejected): the test split keeps only what ``held_out`` holds out."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    fewest, most = digits
    if not 1 <= fewest <= most <= 9:
        raise ValueError(f"digits must be (fewest, most) with 1 <= fewest <= most <= 9, got {digits!r}")
    low, high = 10 ** (fewest - 1), 10**most
    rng = random.Random(rng_seed)
    rows: list[dict] = []
    seen: set[tuple[int, int, str]] = set()
    draws = 0
    while len(rows) < num_prompts:
        draws += 1
        if draws > 1000 * (num_prompts + 100):
            raise ValueError(f"the {split} split of {fewest}-{most} digit {drawn} has fewer than {num_prompts} "
                             f"distinct {unit}; use more digits or fewer prompts")
        proposal = propose(rng, low, high)
        if proposal is None:
            continue
        key, held, row = proposal
        if held_out(*held) != (split == "test") or key in seen:
            continue
        seen.add(key)
        rows.append(row())
    return rows


#: the ``number_only`` task's instruction: the reply is the number alone (no "The answer is" sentence)
NUMBER_ONLY_FORMAT = "Answer with the number only."
#: ``number_only_reward``'s partial credit for a wrong reply that is still a short, well-formed number
NUMBER_ONLY_PARTIAL = 0.1


def number_only_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                     digits: tuple[int, int] = (4, 4)) -> list[dict[str, str]]:
    """A short numeric answer with no answer sentence (issue 52): "What is N + 1? Answer with the number only.", N
    of ``digits`` (fewest, most) digits; the answer is N + 1. Replies can chain the question's own form
    ("N + 1 = N + 1 = ...") to the token limit. ``held_out`` decides by N. Score with ``number_only_reward``
    (1 right, ``NUMBER_ONLY_PARTIAL`` for a wrong short number, 0 otherwise)."""
    def propose(rng: random.Random, low: int, high: int) -> _Proposal:
        n = rng.randrange(low, high)
        key = (n, 1, "+")
        return key, key, lambda: {"prompt": f"What is {n} + 1? {NUMBER_ONLY_FORMAT}", "answer": str(n + 1)}

    return _distinct_rows(num_prompts, split, digits, f"number_only-{split}-{seed}-{digits[0]}-{digits[1]}",
                          "numbers", "problems", propose)


_NUMBER = re.compile(r"-?\d[\d,]*")
_SHORT_NUMBER = re.compile(r"\s*-?\d[\d,]*\s*\.?\s*")


def number_only_reward(reply: str, answer: str) -> float:
    """The ``number_only`` task's reward from the reply's text alone (the same rule for every trainer): 1 when the
    reply's last number (commas dropped) is the answer, ``NUMBER_ONLY_PARTIAL`` when it is wrong but the reply is a
    short, well-formed number (only a number, at most 12 characters, an optional final period), 0 otherwise (no
    number, or a wrong number inside other text: a chain cut at the token limit ends on a wrong one)."""
    numbers = _NUMBER.findall(reply)
    if not numbers:
        return 0.0
    if numbers[-1].replace(",", "") == answer.strip():
        return 1.0
    return NUMBER_ONLY_PARTIAL if len(reply.strip()) <= 12 and _SHORT_NUMBER.fullmatch(reply) else 0.0


#: the ``shape_colour`` task's colours (RGB) by answer: the first letter of the colour's name
SHAPE_COLOURS = {"r": (220, 40, 40), "g": (40, 180, 60), "b": (40, 70, 220), "y": (230, 210, 40)}
#: the canvas of ``shape_colour`` (and the colour of a blank image, ``--data.blank_images``)
CANVAS_SIZE, CANVAS_COLOUR = 56, (128, 128, 128)
#: the prompt text of ``shape_colour``: the same for every image, so that only the image tells the answer
SHAPE_COLOUR_PROMPT = "c="
#: the visual tasks, and the column of their rows that holds the image (a PIL image)
VISUAL_TASKS = ("shape_colour",)
TASK_IMAGE_KEY = "image"


def shape_colour_rows(num_prompts: int, seed: int = 0, split: Literal["train", "test"] = "train",
                      digits: tuple[int, int] = (2, 3)) -> list[dict]:
    """The visual task: a square, circle or triangle of one of four colours (``SHAPE_COLOURS``), of random size
    (half the canvas to all of it) and place, on a grey ``CANVAS_SIZE``-pixel canvas (a PIL image in the row's
    ``image`` column); the prompt is ``c=`` for every row and the answer is the colour's letter (``r``, ``g``, ``b``
    or ``y``), for the ``target_char`` reward: a policy that ignores the image scores at most about 0.27 (the most
    frequent colour everywhere), one that reads it up to 1. ``held_out`` decides by colour, shape, size and place.
    ``digits`` is ignored."""
    from PIL import Image, ImageDraw

    del digits

    def propose(rng: random.Random, low: int, high: int) -> _Proposal:
        colour, shape = rng.choice(sorted(SHAPE_COLOURS)), rng.choice(["square", "circle", "triangle"])
        size = rng.randrange(CANVAS_SIZE // 2, CANVAS_SIZE + 1)
        x, y = rng.randrange(0, CANVAS_SIZE - size + 1), rng.randrange(0, CANVAS_SIZE - size + 1)

        def row() -> dict:
            image = Image.new("RGB", (CANVAS_SIZE, CANVAS_SIZE), CANVAS_COLOUR)
            draw, box, fill = ImageDraw.Draw(image), (x, y, x + size - 1, y + size - 1), SHAPE_COLOURS[colour]
            if shape == "square":
                draw.rectangle(box, fill=fill)
            elif shape == "circle":
                draw.ellipse(box, fill=fill)
            else:
                draw.polygon([(x + size // 2, y), (x, y + size - 1), (x + size - 1, y + size - 1)], fill=fill)
            return {"prompt": SHAPE_COLOUR_PROMPT, "answer": colour, TASK_IMAGE_KEY: image}

        key = (x * 100 + y, size, f"{colour}{shape}")
        return key, key, row

    return _distinct_rows(num_prompts, split, (1, 1), f"shape_colour-{split}-{seed}", "shapes", "images", propose)


#: the embedded tasks by name: ``(num_prompts, seed, split, digits) -> rows`` (``target_char`` ignores ``digits``;
#: ``mixed`` also takes ``judged_share``)
TASKS = {"target_char": lambda n, seed, split, digits: target_char_rows(n, seed + (split == "test") * 10_000),
         "arithmetic": arithmetic_rows, "compare": compare_rows, "mixed": mixed_rows,
         "reveal": lambda n, seed, split, digits: reveal_rows(n, seed + (split == "test") * 10_000),
         "count_letter": count_letter_rows, "middle": middle_rows, "multiply": multiply_rows,
         "count_even": count_even_rows, "digit_sum": digit_sum_rows, "shape_colour": shape_colour_rows,
         "number_only": number_only_rows}
#: the columns of an embedded task's rows that become ``Prompt.metadata``
TASK_METADATA: dict[str, list[str]] = {"mixed": ["reward"]}
