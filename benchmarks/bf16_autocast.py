"""gcore's default tiny workload with ``--trainer.precision`` (``32-true`` or ``bf16-mixed``, Fabric's autocast in the
training stage; the engine still generates in float32): median step, train and generate seconds over steps 3-12,
and the mean reward of the first and last three steps (seed 42).

    python benchmarks/bf16_autocast.py bf16-mixed
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from gcore import GRPO, Trainer, TrainerConfig
from gcore.controller import Controller


def main(precision: str) -> None:
    ends: list[float] = []
    step = Controller.step

    def timed(self, *a, **kw):
        out = step(self, *a, **kw)
        ends.append(time.perf_counter())
        return out

    Controller.step = timed
    with tempfile.TemporaryDirectory() as root:
        result = Trainer(trainer=TrainerConfig(max_steps=12, seed=42, accelerator="cpu", default_root_dir=root,
                                               enable_progress_bar=False, save_final=False, precision=precision),
                         algorithm=GRPO(clip_eps=0.2, kl_coef=0.0, loss_agg="seq_mean_token_mean")).fit()
    steps = [b - a for a, b in zip(ends[1:], ends[2:], strict=False)]
    h = result.history

    def med(key: str) -> float:
        return round(statistics.median(m[key] for m in h[2:]), 3)

    print(precision, "median step", round(statistics.median(steps), 3), "train", med("time/train"),
          "generate", med("time/generate"), "reward first3", round(statistics.mean(m["reward/mean"] for m in h[:3]), 3),
          "last3", round(statistics.mean(m["reward/mean"] for m in h[-3:]), 3))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "32-true")
