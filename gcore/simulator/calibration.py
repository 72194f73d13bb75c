"""Fit the simulator's per-token costs to per-stage times measured in real runs.

A measured run is a ``Setting``: how many samples one device generated and judged per step, the
generation and judge budgets, the lengths seen, and the median stage times from its metrics.csv.
The costs are fitted by non-negative least squares on relative errors, stage by stage, from the
same cost formulas the simulator uses (one device, fixed batches as the ``hf`` engine runs them);
``predict_stages`` then runs the simulator itself on a setting, so a held-out check tests the
simulator and not only the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, cast

from gcore.errors import ConfigError
from gcore.placement import StaticPlacement
from gcore.simulator.model import Workload, simulate

GENERATE_COSTS = ("decode_step_s", "generate_token_s", "context_token_s")
PREFILL_COSTS = ("prefill_token_s",)  # fitted only when asked: the tiny model's 2-token prompts cannot show it
JUDGE_COSTS = ("judge_token_s", "judge_decode_step_s", "judge_generate_token_s", "judge_context_token_s")
TRAIN_COSTS = ("train_step_s", "train_token_s")
SWAPS_PER_STEP = 3  # static placement: to the judge, to training, back to generation


@dataclass
class Setting:
    """One measured configuration of a real run (per device and per step)."""

    prompts: int
    n: int
    max_new_tokens: int
    judge_output_tokens: int
    judge_batch: int
    prompt_tokens: int
    judge_template_tokens: int  # the judge prompt's tokens with an empty response (prompt included)
    response_max: float
    response_mean: float
    measured: dict[str, float] = field(default_factory=dict)  # generate, reward, train, swap seconds
    held_out: bool = False

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    @property
    def length(self) -> int:
        """Decode steps of a fixed batch: its rows all step until the longest ends."""
        return max(1, round(self.response_max))

    @classmethod
    def from_dict(cls, raw: dict) -> Setting:
        known = {f.name for f in fields(cls)}
        missing = sorted(known - set(raw) - {"held_out", "measured"})
        if missing:
            raise ConfigError(f"calibration setting lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in raw.items() if k in known})


def _features(s: Setting, prefill: bool = False) -> dict[str, list[float]]:
    """The stage times as linear functions of the costs (one device, fixed batches, equal lengths);
    with ``prefill``, generation's last column is the policy's prefill (``prefill_token_s``)."""
    b, length, p, j = s.samples, s.length, s.prompt_tokens, s.judge_output_tokens
    generate = [length, length * b, length * b * p + b * length * (length + 1) / 2]
    if prefill:
        generate.append(b * p)
    chunks = [min(s.judge_batch, b - start) for start in range(0, b, s.judge_batch)]
    read = s.judge_template_tokens + length  # the template holds the prompt; the response is appended
    judge = [
        b * read,
        len(chunks) * j,
        b * j,
        sum(j * rows * read + rows * j * (j + 1) / 2 for rows in chunks),
    ]
    train = [1.0, b * (p + length)]
    return {"generate": generate, "reward": judge, "train": train}


def fit_costs(settings: list[Setting], prefill: bool = False) -> dict[str, float]:
    """Per-token costs (seconds) that best explain the measured stage times of ``settings``; with
    ``prefill``, the policy's prefill cost per prompt token too (prompts of real length)."""
    import numpy as np

    try:
        from scipy.optimize import nnls
    except ImportError:
        raise ConfigError("calibrating the simulator needs scipy: pip install 'gcore[simulate]'") from None

    if len(settings) < 3:
        raise ConfigError(f"calibration needs at least 3 measured settings to fit, got {len(settings)}")
    costs: dict[str, float] = {}
    generate_costs = GENERATE_COSTS + PREFILL_COSTS if prefill else GENERATE_COSTS
    for stage, names in (("generate", generate_costs), ("reward", JUDGE_COSTS), ("train", TRAIN_COSTS)):
        rows = np.array([_features(s, prefill)[stage] for s in settings], dtype=float)
        times = np.array([s.measured[stage] for s in settings], dtype=float)
        if (times <= 0).any():
            raise ConfigError(f"calibration: a measured {stage} time is not positive")
        # relative errors: a 0.2 s stage counts as much as a 2 s one; columns scaled to unit size
        scale = np.abs(rows / times[:, None]).max(axis=0)
        scale[scale == 0] = 1.0
        solution, _ = nnls(rows / times[:, None] / scale, np.ones(len(settings)))
        costs.update({name: float(x / c) for name, x, c in zip(names, solution, scale, strict=False)})
    costs["swap_s"] = sum(s.measured.get("swap", 0.0) for s in settings) / len(settings) / SWAPS_PER_STEP
    return costs


def calibrated_workload(costs: dict[str, float], s: Setting) -> Workload:
    """The simulator's workload for setting ``s`` on one device, with the fitted costs."""
    return Workload(
        samples_per_device=s.samples,
        prompt_tokens=s.prompt_tokens,
        median_tokens=float(s.length),
        sigma=0.0,
        max_tokens=s.max_new_tokens,
        length_drift=0.0,
        batching="static",
        max_batch=0,
        judge_max_batch=s.judge_batch,
        judge_prompt_tokens=s.judge_template_tokens - s.prompt_tokens,
        judge_output_tokens=s.judge_output_tokens,
        **cast("dict[str, Any]", {"prefill_token_s": 0.0, **costs}),  # the cost fields, all floats
    )


def predict_stages(work: Workload, s: Setting) -> dict[str, float]:
    """The simulator's stage times for one static-placement step on one device."""
    result = simulate(StaticPlacement(offload=True), 1, 1, work)[0]
    return {
        "generate": result.stages["generate"],
        "reward": result.stages["judge"],
        "train": result.stages["train"],
        "swap": result.stages["swap"],
    }


def workload_yaml(costs: dict[str, float], source: str, workload: str = "tiny",
                  judge_prompt_tokens: int = 95) -> str:
    """A `gcore simulate` YAML: the fitted costs with a long-tailed GenRM length distribution.

    ``workload`` names the calibration runs: ``tiny`` (the embedded model, a judge that writes a
    rationale) or ``smollm2`` (issue 31's workload: SmolLM2-135M-Instruct, the probability verdict,
    which writes nothing: ``judge_output_tokens: 1``); ``judge_prompt_tokens`` is the judge template's
    own tokens.
    """
    if workload == "smollm2":
        header = [
            "# Issue 31's workload for `gcore simulate`, costs fitted to real CPU runs:",
            f"#   python benchmarks/simulator_calibration.py --check {source} --write-yaml <this file>",
            "# (gcore fit, GRPO, SmolLM2-135M-Instruct as policy and judge on the hf engine, the mixed task in",
            "# the chat template with every prompt judged, the judge's probability verdict: one forward pass",
            "# over the judge prompt, the verdict read at one position; static placement, 1 torch thread;",
            "# docs/simulator.md). The lengths below are the long-tailed GenRM workload of",
            "# genrm_cpu_calibrated.yaml, not the calibration runs' (prompts ~42 tokens, responses of 8-32",
            "# tokens, judge prompts of 91-206 tokens): the costs are extrapolated to those lengths. swap_s is",
            "# an estimate: on CPU the hf engine has nothing to offload and the measured swap is ~0 s.",
        ]
        judge_lines = [
            "  judge_output_tokens: 1    # probability verdict: no text, one verdict position",
            f"  judge_prompt_tokens: {judge_prompt_tokens}   # the judge template in the judge's chat template",
        ]
        names: tuple[str, ...] = (*GENERATE_COSTS, *PREFILL_COSTS, *JUDGE_COSTS, *TRAIN_COSTS)
    else:
        header = [
            "# GenRM workload for `gcore simulate`, per-token costs fitted to real CPU runs:",
            f"#   python benchmarks/simulator_calibration.py --check {source} --write-yaml <this file>",
            "# (gcore fit, GRPO, generative judge on the hf engine, embedded 4-layer model as policy and",
            "# judge, static placement, 1 torch thread; see BENCHMARKS.md). The lengths below are a",
            "# long-tailed GenRM workload, not the calibration runs'; swap_s is an estimate: on CPU the",
            "# hf engine has nothing to offload and the measured swap is ~0 s.",
        ]
        judge_lines = [
            "  judge_output_tokens: 256  # a reasoning judge writes a rationale and a verdict",
            f"  judge_prompt_tokens: {judge_prompt_tokens}   # the judge template",
        ]
        names = (*GENERATE_COSTS, *JUDGE_COSTS, *TRAIN_COSTS)
    lines = [
        *header,
        "workload:",
        "  samples_per_device: 32",
        "  prompt_tokens: 256",
        "  median_tokens: 400        # log-normal median at step 0",
        "  sigma: 0.9                # long tail",
        "  max_tokens: 4096",
        "  length_drift: 0.02        # median grows 2% per step",
        "  resample_fraction: 0.2    # dynamic sampling: a fifth of the samples drawn again at step 0",
        "  resample_drift: 0.005     # and more later (more groups all right or all wrong)",
        "  resample_draw: binomial    # each group kept on its own, as real runs keep them (benchmarks/keep_model.py)",
        "  batching: continuous      # a serving engine's continuous batching (the hf engine: static)",
        *judge_lines,
        "  swap_s: 2.0               # estimate (see above)",
        "  # fitted:",
    ]
    lines += [f"  {name}: {costs[name]:.4g}" for name in names]
    lines += [
        "dynamic:",
        "  judge_fraction: 0.25",
        "  min_fraction: 0.125",
        "  hysteresis: 0.1",
        "  max_move_fraction: 0.5   # the sizing is model-based: a large first move is safe",
        "",
    ]
    return "\n".join(lines)


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else math.inf


# -- the asynchronous model against the trainer's engine-worker runs (benchmarks/async_calibration.py) --------------

ASYNC_METRICS = (
    "time/step", "time/train", "time/prepare", "time/reward", "time/sync", "time/generate", "time/rollout",
    "time/idle_generate", "async/rollout_wait_s", "async/partial_samples", "response_length/mean",
    "response_length/max", "response/truncated_frac", "samples/total",
)


@dataclass
class MeasuredRun:
    """One measured ``gcore fit`` run with engine workers (``benchmarks/async_overlap.py --save``), per step.

    ``label``: ``0``, ``1``, ``1p`` (K = 1 with partial rollouts), ``2``, ``2p``; ``metrics``: each of
    ``ASYNC_METRICS`` per step (NaN where the run did not log it).
    """

    label: str
    seed: int
    workers: int
    max_new_tokens: int
    metrics: dict[str, list[float]]
    warmup: int = 2
    load: str = ""

    @property
    def k(self) -> int:
        return int(self.label.rstrip("p"))

    @property
    def partial(self) -> bool:
        return self.label.endswith("p")

    def col(self, name: str) -> list[float]:
        return [0.0 if math.isnan(x) else x for x in self.metrics[name]]

    @property
    def samples(self) -> int:
        return round(self.metrics["samples/total"][-1])

    def busy(self) -> list[float]:
        """Each step's generation busy seconds per worker (the workers' busy time of its rollout)."""
        return [
            (self.workers * (r - w) - i) / self.workers
            for r, w, i in zip(self.col("time/rollout"), self.col("time/reward"), self.col("time/idle_generate"),
                               strict=True)
        ]

    def idle(self) -> float:
        """The generation workers' idle share over the whole run (as benchmarks/async_overlap.py prints it)."""
        return 1.0 - sum(self.busy()) / sum(self.col("time/step"))

    def samples_per_s(self) -> float:
        return sum(self.col("samples/total")[self.warmup:]) / sum(self.col("time/step")[self.warmup:])

    def controller(self) -> list[float]:
        """Each step's time on the controller alone: the step less its wait for generation."""
        wait = self.col("async/rollout_wait_s") if self.k else self.col("time/generate")
        return [s - x for s, x in zip(self.col("time/step"), wait, strict=True)]


def lognormal_for(mean: float, truncated: float, cap: int) -> tuple[float, float]:
    """The log-normal (median, sigma) whose lengths cut at ``cap`` have this mean and share at the cap."""
    from statistics import NormalDist

    unit = NormalDist()
    truncated = min(max(truncated, 1e-3), 1 - 1e-3)
    best = (math.inf, float(cap), 1.0)
    for i in range(1, 400):
        sigma = i / 100
        mu = math.log(cap) - sigma * unit.inv_cdf(1 - truncated)
        z = (math.log(cap) - mu) / sigma
        cut_mean = math.exp(mu + sigma**2 / 2) * unit.cdf(z - sigma) + cap * (1 - unit.cdf(z))
        best = min(best, (abs(cut_mean - mean), math.exp(mu), sigma))
    return best[1], best[2]


def fit_async(runs: list[MeasuredRun]) -> dict[str, float]:
    """The asynchronous model's costs from measured runs (steps after each run's warm-up):

    - ``decode_step_s``: a worker's generation busy seconds over its decode steps (the hf engine runs its
      share as one fixed batch until the longest response ends: ``response_length/max`` steps);
    - ``train_step_s``: the controller's own time per step (reward, prepare, train, sync: the step less
      its wait for generation), the mean;
    - ``swap_s``: a weight load, estimated by the sync's median (the workers' load time is not logged);
    - ``median_tokens``, ``sigma``: the log-normal lengths whose cut at ``max_new_tokens`` gives the mean
      length and the share of responses at the cap.
    """
    if not runs:
        raise ConfigError("fit_async needs at least one measured run")
    busy = [x for r in runs for x in r.busy()[r.warmup:]]
    steps = [x for r in runs for x in r.col("response_length/max")[r.warmup:]]
    controller = [x for r in runs for x in r.controller()[r.warmup:]]
    syncs = sorted(x for r in runs for x in r.col("time/sync")[r.warmup:])
    mean = sum(x for r in runs for x in r.col("response_length/mean")[r.warmup:]) / len(busy)
    truncated = sum(x for r in runs for x in r.col("response/truncated_frac")[r.warmup:]) / len(busy)
    median, sigma = lognormal_for(mean, truncated, runs[0].max_new_tokens)
    return {
        "decode_step_s": sum(busy) / sum(steps),
        "train_step_s": sum(controller) / len(controller),
        "swap_s": syncs[len(syncs) // 2],
        "median_tokens": median,
        "sigma": sigma,
    }


def async_workload(costs: dict[str, float], run: MeasuredRun) -> Workload:
    """The simulator's workload for a measured run: ``run.workers`` generation devices, one training device and
    one judge device that costs nothing (the rule-based reward runs on the controller, in ``train_step_s``)."""
    devices = run.workers + 2
    if run.samples % devices:
        raise ConfigError(f"{run.samples} samples per step do not split over {devices} simulated devices")
    return Workload(
        samples_per_device=run.samples // devices, prompt_tokens=0, median_tokens=costs["median_tokens"],
        sigma=costs["sigma"], max_tokens=run.max_new_tokens, length_drift=0.0, batching="static",
        decode_step_s=costs["decode_step_s"], generate_token_s=0.0, judge_token_s=0.0, judge_generate_token_s=0.0,
        judge_decode_step_s=0.0, judge_output_tokens=1, swap_s=costs["swap_s"], train_token_s=0.0,
        train_step_s=costs["train_step_s"],
    )


def predict_async(costs: dict[str, float], run: MeasuredRun) -> dict[str, float]:
    """The simulator's generation idle share, samples/s and median step for a measured run's K and partial
    rollouts (the trainer's dispatch, a training device of its own, the run's seed and steps)."""
    from gcore.placement import DynamicPlacement
    from gcore.simulator.asynchronous import simulate_async

    steps = len(run.metrics["time/step"])
    results = simulate_async(
        DynamicPlacement(hysteresis=1e9), run.workers + 2, steps, async_workload(costs, run), run.seed, run.k,
        run.partial, "step", train_devices=1,
    )
    times = [r.step_s for r in results]
    busy = sum(r.busy["generate"] for r in results)
    timed = sorted(times[run.warmup:])
    return {
        "idle": 1.0 - busy / (run.workers * sum(times)),
        "samples_per_s": run.samples * len(timed) / sum(timed),
        "step": timed[len(timed) // 2],
        "cut": float(sum(r.cut for r in results)),
    }
