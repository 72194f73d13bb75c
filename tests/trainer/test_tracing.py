"""Rollout tracing (``gcore/tracing.py``): the tiny default model through the in-process Trainer."""

import glob
import math
import os

import pandas as pd
import pytest
import torch
from conftest import run_gcore_here

from gcore.algorithms.base import group_normalize
from gcore.data import DataConfig
from gcore.errors import ConfigError
from gcore.model import ModelConfig
from gcore.testing import make_sample
from gcore.tracing import Tracer, choose, read_samples, record_of
from gcore.trainer import Trainer, TrainerConfig
from gcore.types import SamplingParams


def _fit(root, **trainer):
    return Trainer(
        trainer=TrainerConfig(default_root_dir=str(root), enable_progress_bar=False, save_final=False, **trainer),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(prompts_per_step=4),
        sampling=SamplingParams(n=4, max_new_tokens=6),
    ).fit()


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Two steps, every sample traced, to metrics.csv and TensorBoard."""
    return _fit(tmp_path_factory.mktemp("traced"), max_steps=2, trace_samples=0, logger=["csv", "tensorboard"])


def test_every_sample_is_traced_with_what_the_step_computed(traced):
    frame = pd.read_json(os.path.join(traced.run_dir, "samples.jsonl"), lines=True)  # pandas reads it directly
    assert sorted(frame["step"].unique()) == [0, 1]
    records = read_samples(traced.run_dir)
    assert len(records) == 2 * 16  # 4 prompts x 4 samples per step
    for step, metrics in enumerate(traced.history):
        rows = [r for r in records if r["step"] == step]
        assert math.isclose(sum(r["reward"] for r in rows) / len(rows), metrics["reward/mean"], abs_tol=1e-9)
        assert sum(r["length"] for r in rows) / len(rows) == pytest.approx(metrics["response_length/mean"])
        truncated = sum(r["finish_reason"] == "length" for r in rows) / len(rows)
        assert truncated == pytest.approx(metrics["response/truncated_frac"])
        # the advantages are GRPO's of the step's rewards, group by group
        expected = group_normalize(torch.tensor([r["shaped_reward"] for r in rows]),
                                   torch.tensor([r["group"] for r in rows]), scale=True)
        assert [r["advantage"] for r in rows] == pytest.approx(expected.tolist(), abs=1e-5)
        # the per-sample gap comes from the loss's own forward: token-weighted, it is the step's metric
        gapped = [r for r in rows if r["logprob_gap"] is not None]
        assert gapped, "no sample has a logprob gap"
        assert all(r["advantage"] != 0.0 for r in gapped)  # the rows the backend ran (zero advantage: skipped)
        weighted = sum(r["logprob_gap"] * r["length"] for r in gapped) / sum(r["length"] for r in gapped)
        assert weighted == pytest.approx(metrics["rollout/logprob_diff"], rel=1e-4)
        assert all(r["policy_version"] == step == r["version_min"] == r["version_max"] for r in rows)
        assert all(r["staleness"] == 0 and r["turns"] == 1 and r["images"] == [] for r in rows)
        assert all(r["prompt"] and isinstance(r["reply"], str) and "raw" in r["reward_parts"] for r in rows)
        assert metrics["time/trace"] > 0
    # the same samples went to TensorBoard's text view
    events = glob.glob(os.path.join(os.path.dirname(traced.run_dir), "*", "events.out.tfevents.*"))
    assert events and any(b"samples/text_summary" in open(e, "rb").read() for e in events)


def test_gcore_samples_shows_best_median_and_worst(traced):
    result = run_gcore_here("samples", traced.run_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("step 1: 16 samples traced (their reward: mean")
    for label in ("== best", "== median", "== worst", "-- prompt", "-- reply"):
        assert label in result.stdout
    best = max(r["reward"] for r in read_samples(traced.run_dir) if r["step"] == 1)
    assert f"== best: reward {best:.4g}" in result.stdout
    assert run_gcore_here("samples", traced.run_dir, "--step", "0").stdout.startswith("step 0:")
    missing = run_gcore_here("samples", traced.run_dir, "--step", "7")
    assert missing.returncode == 2 and "--step 7: no samples traced at that step; traced steps: 0, 1" in missing.stderr


def test_the_bounds_are_honoured(tmp_path):
    result = _fit(tmp_path, max_steps=3, trace_every=2, trace_samples=3)
    records = read_samples(result.run_dir)
    assert [r["step"] for r in records] == [0, 0, 0, 2, 2, 2]
    assert len(result.history) == 3 and result.history[1]["time/trace"] == 0.0


def test_a_torn_last_line_is_skipped(traced, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    whole = open(os.path.join(traced.run_dir, "samples.jsonl")).read()
    (run / "samples.jsonl").write_text(whole + whole.splitlines()[0][:40])  # a crash in mid-write
    assert len(read_samples(str(run))) == 32
    assert run_gcore_here("samples", str(run)).returncode == 0


def test_choose_keeps_the_best_median_and_worst():
    samples = [make_sample("p", f"r{i}", group=i) for i in range(10)]
    for i, s in enumerate(samples):
        s.reward = float((i * 7) % 10)  # 0..9, shuffled
    chosen = choose(samples, 3)
    assert [s.reward for s in chosen] == [0.0, 4.0, 9.0]
    assert [s.reward for s in choose(samples, 5)][0::4] == [0.0, 9.0] and len(choose(samples, 5)) == 5
    assert len(choose(samples, 0)) == 10


def test_the_size_cap_stops_the_trace(tmp_path, capsys):
    samples = [make_sample("prompt " * 20, "reply " * 50, group=i) for i in range(4)]
    (tmp_path / "free").mkdir()
    Tracer.open(str(tmp_path / "free"), 0, every=1, limit=0, max_mb=0, start_step=0).trace(0, samples, [], None)
    step_bytes = os.path.getsize(tmp_path / "free" / "samples.jsonl")
    cap = 1.5 * step_bytes / 1e6  # room for one step, not two
    tracer = Tracer.open(str(tmp_path), 0, every=1, limit=0, max_mb=cap, start_step=0)
    tracer.trace(0, samples, [], None)
    assert os.path.getsize(tmp_path / "samples.jsonl") == step_bytes and not tracer.full
    tracer.trace(1, samples, [], None)
    assert os.path.getsize(tmp_path / "samples.jsonl") == step_bytes and tracer.full
    tracer.trace(2, samples, [], None)
    assert [r["step"] for r in read_samples(str(tmp_path))] == [0] * 4
    assert f"reached --trainer.trace_max_mb {cap:g}: no more samples are traced from step 1" in capsys.readouterr().err


def test_a_resumed_run_drops_the_steps_it_redoes(tmp_path):
    samples = [make_sample("p", "r", group=i) for i in range(2)]
    tracer = Tracer.open(str(tmp_path), 0, every=1, limit=0, max_mb=0, start_step=0)
    for step in range(3):
        tracer.trace(step, samples, [], None)
    assert [r["step"] for r in read_samples(str(tmp_path))] == [0, 0, 1, 1, 2, 2]
    resumed = Tracer.open(str(tmp_path), 0, every=1, limit=0, max_mb=0, start_step=1)
    assert [r["step"] for r in read_samples(str(tmp_path))] == [0, 0]
    resumed.trace(1, samples[:1], [], None)
    assert [r["step"] for r in read_samples(str(tmp_path))] == [0, 0, 1]


def test_bad_bounds_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"--trainer.trace_samples must be >= 0 \(0: every sample"):
        TrainerConfig(trace_samples=-1).validate()


def test_a_record_names_the_prompts_images_and_a_cut_episode():
    sample = make_sample("what colour?", "red")
    sample.prompt.metadata = {"images": ["img/0.png", "img/1.JPG"], "topic": "colour", "feature": None}
    sample.finished, sample.response_mask, sample.turns = False, [1, 1, 1], 2
    sample.token_versions = [3, 3, 4]
    record = record_of(sample, step=5, rank=0, advantage=None, gap=None, transcript="red\n[obs]\nred")
    assert record["images"] == ["img/0.png", "img/1.JPG"]
    assert record["finish_reason"] == "cut" and record["turns"] == 2 and record["transcript"] == "red\n[obs]\nred"
    assert (record["version_min"], record["version_max"], record["staleness"]) == (3, 4, 2)
    assert record["trained"] is False and record["advantage"] is None


def test_gcore_samples_on_a_folder_without_samples(tmp_path):
    result = run_gcore_here("samples", str(tmp_path))
    assert result.returncode == 2
    assert f"{tmp_path}: no samples.jsonl (rollout tracing writes it: --trainer.trace_every N" in result.stderr
