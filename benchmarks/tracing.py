"""What rollout tracing costs a step: ``time/trace`` (the seconds the tracer took: choosing, per-sample figures,
JSON, the append and flush, the loggers) against ``time/step``, on gcore's default workload (the embedded tiny
model and task, `gcore fit`'s defaults: 16 prompts x 8 samples, 16 new tokens, one in-process controller).

The tiny model's step is short (tens of milliseconds), so this is the worst case for the share; a real model's step
is seconds and the tracer's time does not grow with the model (it handles ``trace_samples`` records of text).
Each setting runs in this process, one after the other; the first step of each run (set-up effects) is left out.

    python benchmarks/tracing.py --steps 30 --settings 8,0 --loggers csv
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from gcore.trainer import Trainer, TrainerConfig


def run(steps: int, samples: int, loggers: list[str]) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="gcore-trace-bench-")
    config = TrainerConfig(max_steps=steps, default_root_dir=root, enable_progress_bar=False, save_final=False,
                           trace_samples=samples, logger=loggers)  # type: ignore[arg-type]  # names checked by Trainer
    result = Trainer(trainer=config).fit()
    history = result.history[1:]
    trace = [m["time/trace"] for m in history]
    step = [m["time/step"] for m in history]
    assert result.run_dir is not None
    size = os.path.getsize(os.path.join(result.run_dir, "samples.jsonl"))
    return {"trace_ms": 1e3 * statistics.median(trace), "step_ms": 1e3 * statistics.median(step),
            "share_pct": 100 * statistics.median(t / s for t, s in zip(trace, step, strict=True)),
            "share_of_sums_pct": 100 * sum(trace) / sum(step), "kb_per_step": size / 1e3 / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--settings", default="8,0", help="--trainer.trace_samples values, comma-separated")
    parser.add_argument("--loggers", default="csv", help="--trainer.logger names, comma-separated")
    args = parser.parse_args()
    loggers = args.loggers.split(",")
    print(f"steps {args.steps} (the first left out), loggers {loggers}")
    print(f"{'trace_samples':>13} {'trace ms':>9} {'step ms':>8} {'median share %':>15} {'share of sums %':>16} "
          f"{'kB/step':>8}")
    for setting in args.settings.split(","):
        r = run(args.steps, int(setting), loggers)
        print(f"{setting:>13} {r['trace_ms']:9.3f} {r['step_ms']:8.1f} {r['share_pct']:15.2f} "
              f"{r['share_of_sums_pct']:16.2f} {r['kb_per_step']:8.2f}", flush=True)


if __name__ == "__main__":
    main()
