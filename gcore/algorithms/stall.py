"""A run that trains nothing step after step says so while it runs (issue 52).

With outcome rewards, a group whose samples all score the same gets zero advantages and no gradient. When every
group ties, the step trains no sample: the weights stay where they are (no KL, no entropy bonus), the next step
samples the same distribution, and a run can spend the rest of its steps like that without a word (seen on
SmolLM2-135M: replies shrank from 22 to 2 tokens in four steps, every reply became a short wrong number worth the
same partial credit, and nothing trained after that). ``StallWatch`` counts such steps from the metrics each step
logs and gives one line when ``after`` of them come in a row.
"""

from __future__ import annotations


def trained_nothing(metrics: dict[str, float]) -> bool:
    """Whether a step's update trained no sample: no row ran forward and backward (``trained_rows_frac`` 0: every
    row's advantages were zero, so gcore skipped them), or the gradient was exactly zero (the same, with
    ``--backend.skip_inert_rows false``). A step that logs neither figure counts as trained."""
    rows = metrics.get("trained_rows_frac")
    grad = metrics.get("grad_norm")
    return rows == 0.0 or grad == 0.0


class StallWatch:
    """Counts the steps in a row that trained no sample; ``update`` returns the line to print when the count reaches
    ``after`` (once per stretch: a step that trains starts the count again), else ``None``."""

    def __init__(self, after: int = 4) -> None:
        if after < 1:
            raise ValueError(f"after must be >= 1, got {after}")
        self.after = after
        self.streak = 0
        self.lengths: list[float] = []

    def update(self, step: int, metrics: dict[str, float]) -> str | None:
        if not trained_nothing(metrics):
            self.streak, self.lengths = 0, []
            return None
        self.streak += 1
        self.lengths.append(float(metrics.get("response_length/mean", float("nan"))))
        if self.streak != self.after:
            return None
        first, last = self.lengths[0], self.lengths[-1]
        return (f"gcore: step {step}: no sample trained for {self.streak} steps in a row (every group's rewards tied, "
                f"so every advantage was 0); mean reply length {first:.1f} -> {last:.1f} tokens over those steps")
