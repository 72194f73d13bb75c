"""``gcore report RUN_DIR``: PNG plots of a run's metrics, a short text summary and the run report page
(``report.html``, ``gcore/report_page.py``)."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence

from gcore.errors import GcoreError

#: one figure per panel: (title, metric columns)
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean", "reward/std"]),
    ("response_length", ["response_length/mean", "response_length/max"]),
    ("kl_entropy", ["kl", "entropy"]),
    ("loss", ["loss", "grad_norm"]),
    ("stage_times", ["time/generate", "time/reward", "time/swap", "time/prepare", "time/train", "time/sync"]),
    ("eval_accuracy", ["eval/accuracy_greedy", "eval/accuracy_sampled"]),  # with --trainer.eval_every
]


def read_metrics(run_dir: str) -> list[dict[str, float]]:
    """The rows of ``metrics.csv`` as floats (missing cells are NaN)."""
    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.isfile(path):
        raise GcoreError(f"{run_dir}: no metrics.csv (expected a run folder such as gcore_runs/gcore/version_0)")
    rows = []
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                rows.append({k: float(v) if v not in ("", None) else math.nan for k, v in row.items()})
            except ValueError as err:
                raise GcoreError(f"{path}:{line}: not a number: {err}") from None
    if not rows:
        raise GcoreError(f"{path}: no rows yet")
    return rows


def summary(rows: list[dict[str, float]]) -> str:
    """A few lines: steps, reward first/last, time per step and where it goes."""
    def mean(key: str, part: list[dict[str, float]]) -> float:
        values = [r[key] for r in part if key in r and not math.isnan(r[key])]
        return sum(values) / len(values) if values else math.nan

    all_rows = rows
    # training steps only: each evaluation has a row of its own, with no reward
    rows = [r for r in rows if not math.isnan(r.get("reward/mean", math.nan))] or rows
    k = max(1, min(5, len(rows) // 2))
    first, last = rows[:k], rows[-k:]
    lines = [
        f"steps: {len(rows)}",
        f"reward/mean: first {k} steps {mean('reward/mean', first):.4f}, "
        f"last {k} steps {mean('reward/mean', last):.4f}",
        f"response_length/mean: {mean('response_length/mean', first):.1f} -> {mean('response_length/mean', last):.1f}",
    ]
    step = mean("time/step", rows)
    if not math.isnan(step):
        parts = []
        for stage in ("generate", "reward", "swap", "prepare", "train", "sync"):
            t = mean(f"time/{stage}", rows)
            if not math.isnan(t):
                parts.append(f"{stage} {100 * t / step:.0f}%")
        lines.append(f"time/step: {step:.3f} s ({', '.join(parts)})")
    for key in ("eval/accuracy_greedy", "eval/accuracy_sampled"):
        evals = [(r.get("step", math.nan), r[key]) for r in all_rows if not math.isnan(r.get(key, math.nan))]
        if evals:
            lines.append(f"{key}: {evals[0][1]:.3f} at step {evals[0][0]:g} -> {evals[-1][1]:.3f} at step "
                         f"{evals[-1][0]:g} ({len(evals)} evaluations)")
    placement = sorted(key for key in rows[-1] if key.startswith("placement/"))
    if placement:
        lines.append("placement (last step): " + ", ".join(f"{key[10:]}={rows[-1][key]:g}" for key in placement))
    return "\n".join(lines)


def render(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write one PNG per panel (and placement metrics when present); returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GcoreError("gcore report needs matplotlib: pip install 'gcore[report]'") from None
    rows = read_metrics(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    panels = list(PANELS)
    placement = sorted(key for key in rows[0] if key.startswith("placement/"))
    if placement:
        panels.append(("placement", placement))
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    written = []
    for title, keys in panels:
        present = [key for key in keys if any(not math.isnan(r.get(key, math.nan)) for r in rows)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for key in present:  # only the steps that logged the key (evaluations run every N steps)
            points = [(x, r[key]) for x, r in zip(steps, rows, strict=False) if not math.isnan(r.get(key, math.nan))]
            ax.plot(*zip(*points, strict=False), label=key, marker="." if len(points) < 50 else None)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{title}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def report_main(argv: Sequence[str]) -> int:
    """``gcore report RUN_DIR [--out DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="gcore report", description="Plot a run's metrics and summarise it.")
    parser.add_argument("run_dir", help="a run folder holding metrics.csv")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    parser.add_argument("--html", default=None, help="where to write the report page (default RUN_DIR/report.html)")
    args = parser.parse_args(list(argv))
    rows = read_metrics(args.run_dir)
    text = summary(rows)
    print(text)
    for path in render(args.run_dir, args.out):
        print(f"wrote {path}")
    print(f"wrote {write_report_page(args.run_dir, rows, text, args.html)}")
    return 0


def write_report_page(run_dir: str, rows: list[dict[str, float]], text: str, out: str | None = None) -> str:
    """The run report page (``report_page.write_page``) with the run's traced samples, when it has any."""
    import glob

    from gcore.report_page import write_page
    from gcore.tracing import read_samples

    records = read_samples(run_dir) if glob.glob(os.path.join(run_dir, "samples*.jsonl")) else []
    return write_page(run_dir, rows, records, text, out)
