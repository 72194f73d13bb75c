"""The embedded default task: a synthetic prompt set that a randomly initialised model can learn."""

from __future__ import annotations

import random


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
