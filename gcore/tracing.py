"""Rollout tracing: each traced step's samples as JSON Lines in the run folder, and ``gcore samples RUN_DIR``.

Every ``--trainer.trace_every`` steps, each controller appends at most ``--trainer.trace_samples`` of its step's
samples (spread over the reward range: the best, the worst and the median always among them) to a file of its own
in the run folder: ``samples.jsonl`` (rank 0), ``samples.rank<R>.jsonl`` (rank R >= 1, when every process runs a
controller; with ``--trainer.controllers 1`` rank 0 holds every sample and writes alone). No controller waits for
another: the files are merged when read (``read_samples``). Each record is one whole line, flushed at once, so a
crash loses at most the line being written; a torn last line is skipped when read. The run's files stop growing at
``--trainer.trace_max_mb`` (one note). Rank 0 also hands its records to the loggers with a text or table view
(TensorBoard ``add_text``, W&B ``log_table``, MLflow ``log_text``). docs/observability.md lists the fields.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gcore.errors import GcoreError
from gcore.run_config import TrainerConfig
from gcore.types import RolloutBatch, Sample

FILE = "samples.jsonl"


def rank_file(rank: int) -> str:
    """The file rank ``rank`` writes its records to."""
    return FILE if rank == 0 else f"samples.rank{rank}.jsonl"


def finish_reason(sample: Sample) -> str:
    """``stop``: the model (or, in an episode, the environment) ended it; ``length``: a single-turn response cut at
    ``--sampling.max_new_tokens``; ``cut``: an episode that the environment did not end (cut at its turn or token
    budget, or failed)."""
    if sample.finished:
        return "stop"
    return "cut" if sample.response_mask is not None else "length"


def _number(value: float) -> float | None:
    """A finite float, or ``None`` (JSON has no NaN)."""
    value = float(value)
    return value if math.isfinite(value) else None


def per_sample(batch: RolloutBatch | None, kept: Sequence[Sample]) -> tuple[dict[int, float], dict[int, float]]:
    """The advantage and the engine-vs-trainer log-probability gap of each trained sample, by its ``id``: from the
    batch PREPARE made (its ``row_ids`` index ``kept``) and the gaps the loss recorded on its first pass over each
    row. A sample whose row this controller did not train (not kept; a row with zero advantage that the backend
    skips; another rank's rows under ``--trainer.controllers 1``) has none."""
    advantages: dict[int, float] = {}
    gaps: dict[int, float] = {}
    if batch is None or batch.row_ids is None or not kept:
        return advantages, gaps
    rows = batch.row_ids.tolist()
    if batch.advantages is not None:
        adv = batch.advantages.detach().float().cpu()
        if adv.dim() == 2:  # per token (PPO): the mean over the sample's trained tokens
            mask = (batch.response_mask.detach().cpu() > 0).float()
            adv = (adv * mask).sum(-1) / mask.sum(-1)
        for row, value in zip(rows, adv.tolist(), strict=True):
            if row < len(kept) and (number := _number(value)) is not None:
                advantages[id(kept[row])] = number
    for row_ids, gap in batch.logprob_gaps or []:
        for row, value in zip(row_ids.tolist(), gap.float().cpu().tolist(), strict=True):
            sample_id = id(kept[row]) if row < len(kept) else None
            if sample_id is not None and sample_id not in gaps and (number := _number(value)) is not None:
                gaps[sample_id] = number  # the first pass: before any update of this step
    return advantages, gaps


def choose(samples: Sequence[Sample], limit: int) -> list[Sample]:
    """At most ``limit`` samples (0: all) spread evenly over the reward order: the worst, the median and the best
    are always among them (for ``limit`` >= 3), in reward order."""
    if not limit or len(samples) <= limit:
        return list(samples)
    ordered = sorted(samples, key=lambda s: s.reward)
    last, median = len(ordered) - 1, (len(ordered) - 1) // 2
    picks = [median] if limit == 1 else [0, last] if limit == 2 else [0, median, last]
    for index in [round(k * last / (limit - 1)) for k in range(limit)] + list(range(len(ordered))):
        if len(picks) >= limit:
            break
        if index not in picks:
            picks.append(index)
    return [ordered[i] for i in sorted(picks)]


def record_of(sample: Sample, step: int, rank: int, advantage: float | None, gap: float | None,
              transcript: str | None) -> dict[str, Any]:
    """One sample as a JSON-ready record (the fields docs/observability.md lists)."""
    versions = sample.token_versions or [sample.policy_version]
    prompt = sample.prompt
    images = [str(v) for key, value in prompt.metadata.items() if key != "feature"
              for v in (value if isinstance(value, list) else [value])
              if isinstance(v, str) and re.search(r"\.(png|jpe?g|gif|webp|bmp)$", v, re.IGNORECASE)]
    record: dict[str, Any] = {
        "step": step,
        "rank": rank,
        "prompt_index": prompt.index,
        "group": sample.group,
        "prompt": prompt.content if prompt.content is not None else prompt.text,
        "reply": sample.response_text,
        "reward": _number(sample.reward_info.get("raw", sample.reward)),
        "shaped_reward": _number(sample.reward),
        "reward_parts": {k: _number(v) for k, v in sample.reward_info.items() if isinstance(v, int | float)},
        "advantage": advantage,
        "trained": advantage is not None,
        "length": len(sample.response_ids),
        "prompt_length": len(prompt.token_ids),
        "finish_reason": finish_reason(sample),
        "policy_version": sample.policy_version,
        "version_min": min(versions),
        "version_max": max(versions),
        "staleness": step - min(versions),
        "logprob_gap": gap,
        "turns": sample.turns,
        "env_reward": _number(sample.env_reward),
        "tool_calls": sample.env_metrics.get("tool_calls"),
        "env_metrics": dict(sample.env_metrics),
        "images": images,
    }
    if prompt.answer is not None:
        record["answer"] = prompt.answer
    if transcript is not None:
        record["transcript"] = transcript
    return record


@dataclass
class Tracer:
    """One controller's rollout tracing: ``trace`` after each step. ``path`` ``None``: this controller traces
    nothing (tracing off, or no run folder)."""

    path: str | None
    rank: int
    every: int
    limit: int
    max_bytes: int
    decode: Any = None  # the tokenizer's ``decode``, for an episode's whole transcript
    loggers: Sequence[Any] = ()
    written: int = 0  # bytes in the run's trace files so far (this controller's own, after the first step)
    full: bool = False
    records: int = 0  # records written by this run

    @classmethod
    def open(cls, run_dir: str | None, rank: int, every: int, limit: int, max_mb: float, start_step: int,
             decode: Any = None, loggers: Sequence[Any] = ()) -> Tracer:  # noqa: ANN401  a tokenizer's method
        """The tracer of rank ``rank``; a resumed run (``start_step`` > 0) drops the records of the steps it redoes."""
        if run_dir is None or every <= 0:
            return cls(None, rank, every, limit, 0)
        path = os.path.join(run_dir, rank_file(rank))
        if os.path.isfile(path):
            _keep_before(path, start_step)
        written = os.path.getsize(path) if os.path.isfile(path) else 0
        return cls(path, rank, every, limit, int(max_mb * 1e6), decode, loggers, written)

    def wants(self, step: int) -> bool:
        return self.path is not None and not self.full and step % self.every == 0

    def trace(self, step: int, samples: Sequence[Sample], kept: Sequence[Sample], batch: RolloutBatch | None
              ) -> float:
        """Append the step's chosen samples (when it is a traced step); returns the seconds it took."""
        if not self.wants(step) or not samples:
            return 0.0
        started = time.perf_counter()
        advantages, gaps = per_sample(batch, kept)
        records = []
        for sample in choose(samples, self.limit):
            transcript = None
            if sample.response_mask is not None and self.decode is not None:  # an episode: every turn and observation
                transcript = self.decode(sample.response_ids, skip_special_tokens=False)
            records.append(record_of(sample, step, self.rank, advantages.get(id(sample)), gaps.get(id(sample)),
                                     transcript))
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        if self.max_bytes and self.written + len(lines) > self.max_bytes:
            self.full = True
            print(f"gcore: note: {self.path} reached --trainer.trace_max_mb {self.max_bytes / 1e6:g}: "
                  f"no more samples are traced from step {step}", file=sys.stderr, flush=True)
            return time.perf_counter() - started
        assert self.path is not None  # wants() checked it
        with open(self.path, "ab") as f:  # whole lines, flushed at once: a crash tears at most the last one
            f.write(lines)
            f.flush()
        self.written += len(lines)
        self.records += len(records)
        for logger in self.loggers:
            log_samples(logger, step, records)
        return time.perf_counter() - started


def open_tracer(fabric: Any, run_dir: str | None, central: bool, config: TrainerConfig, start_step: int,  # noqa: ANN401
                tokenizer: Any) -> Tracer:  # noqa: ANN401  Lightning's Fabric, a transformers tokenizer
    """This controller's tracer: its file in the run folder (rank 0's, told to the other controllers once: each
    writes a file of its own there); none on the ranks that hold no samples of their own
    (``--trainer.controllers 1``: rank 0 traces every sample)."""
    rank = fabric.global_rank
    if config.trace_every > 0 and fabric.world_size > 1 and not central:
        run_dir = fabric.broadcast(run_dir, src=0)
    if config.trace_every <= 0 or (central and rank != 0):
        run_dir = None
    return Tracer.open(run_dir, rank, config.trace_every, config.trace_samples, config.trace_max_mb, start_step,
                       tokenizer.decode, fabric.loggers if rank == 0 else ())


def _keep_before(path: str, start_step: int) -> None:
    """Keep only the records of the steps before ``start_step`` (a resumed run redoes the others)."""
    kept = [line for line in _lines(path) if _step_of(line) is not None and _step_of(line) < start_step]  # type: ignore[operator]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in kept)
    os.replace(tmp, path)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _lines(path: str) -> Iterable[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.endswith("\n") and line.strip():  # a torn last line (a crash mid-write) has no newline
                yield line.rstrip("\n")


def markdown(records: Sequence[dict[str, Any]]) -> str:
    """The records as a Markdown table (TensorBoard's text view renders it)."""
    def cell(value: object) -> str:
        text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")[:400]

    columns = ["reward", "advantage", "length", "finish_reason", "logprob_gap", "prompt", "reply"]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    rows += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in records]
    return "\n".join(rows)


def log_samples(logger: Any, step: int, records: Sequence[dict[str, Any]]) -> None:  # noqa: ANN401  a Lightning logger
    """Hand the records to a logger with a text or table view: TensorBoard (``add_text``), W&B (a table),
    MLflow (a Markdown file per step); a CSV logger has none."""
    kind = type(logger).__name__
    if kind == "TensorBoardLogger":
        logger.experiment.add_text("samples", markdown(records), global_step=step)
    elif kind == "WandbLogger":
        columns = ["step", "reward", "advantage", "length", "finish_reason", "logprob_gap", "prompt", "reply"]
        logger.log_table(key="samples", columns=columns, data=[[r.get(c) for c in columns] for r in records],
                         step=step)
    elif kind == "MLFlowLogger":
        logger.experiment.log_text(logger.run_id, markdown(records), f"samples/step_{step:06d}.md")


def read_samples(run_dir: str) -> list[dict[str, Any]]:
    """Every traced record of the run (every rank's file), in step then rank order; torn lines are skipped."""
    paths = sorted(glob.glob(os.path.join(run_dir, "samples*.jsonl")))
    if not paths:
        raise GcoreError(f"{run_dir}: no {FILE} (rollout tracing writes it: --trainer.trace_every N, on by "
                         "default; expected a run folder such as gcore_runs/gcore/version_0)")
    records = []
    for path in paths:
        for number, line in enumerate(_lines(path), start=1):
            try:
                record = json.loads(line)
            except ValueError:
                print(f"gcore: note: {path}:{number}: not a JSON record, skipped", file=sys.stderr)
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    records.sort(key=lambda r: (r["step"], r.get("rank", 0)))
    return records


def best_worst_median(records: Sequence[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The best, the median and the worst record by reward (records without a reward last)."""
    scored = sorted((r for r in records if r.get("reward") is not None), key=lambda r: r["reward"])
    if not scored:
        return []
    return [("best", scored[-1]), ("median", scored[(len(scored) - 1) // 2]), ("worst", scored[0])]


def show(records: Sequence[dict[str, Any]], step: int | None, width: int = 400) -> str:
    """The terminal view of ``gcore samples``: a step's best, median and worst samples."""
    steps = sorted({r["step"] for r in records})
    if not steps:
        return "no samples traced"
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise GcoreError(f"--step {step}: no samples traced at that step; traced steps: "
                         f"{_ranges(steps)}")
    chosen = [r for r in records if r["step"] == step]
    rewards = [r["reward"] for r in chosen if r.get("reward") is not None]
    lines = [f"step {step}: {len(chosen)} samples traced (their reward: mean "
             f"{sum(rewards) / max(len(rewards), 1):.4f}, min {min(rewards, default=math.nan):.4g}, "
             f"max {max(rewards, default=math.nan):.4g})"]

    def clip(text: str) -> str:  # one line per text: its line breaks shown as \n
        text = text.strip().replace("\n", "\\n")
        return text if len(text) <= width else text[:width] + f"... ({len(text) - width} more characters)"

    for label, r in best_worst_median(chosen):
        parts = ", ".join(f"{k} {v:.4g}" for k, v in (r.get("reward_parts") or {}).items()
                          if isinstance(v, int | float) and k != "raw")
        gap = r.get("logprob_gap")
        adv = r.get("advantage")
        lines += [
            "",
            f"== {label}: reward {r['reward']:.4g}" + (f" ({parts})" if parts else "")
            + f", advantage {'-' if adv is None else f'{adv:.4g}'}, {r.get('length')} tokens, "
            f"{r.get('finish_reason')}, policy version {r.get('version_min')}"
            + (f"-{r.get('version_max')}" if r.get("version_max") != r.get("version_min") else "")
            + f", logprob gap {'-' if gap is None else f'{gap:.3g}'}"
            + (f", {r['turns']} turns" if r.get("turns", 1) > 1 else ""),
            f"-- prompt (#{r.get('prompt_index')}): {clip(str(r.get('prompt', '')))}",
            f"-- reply: {clip(str(r.get('reply', '')))}",
        ]
    return "\n".join(lines)


def _ranges(steps: Sequence[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:20])
    return shown + (f", ... ({len(steps)} in all, last {steps[-1]})" if len(steps) > 20 else "")


def samples_main(argv: Sequence[str]) -> int:
    """``gcore samples RUN_DIR [--step K] [--width N]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="gcore samples",
                                     description="Show the best, median and worst traced samples of a step.")
    parser.add_argument("run_dir", help="a run folder holding samples.jsonl")
    parser.add_argument("--step", type=int, default=None, help="the step to show (default: the last traced)")
    parser.add_argument("--width", type=int, default=400, help="characters of each prompt and reply shown")
    args = parser.parse_args(list(argv))
    print(show(read_samples(args.run_dir), args.step, args.width))
    return 0
