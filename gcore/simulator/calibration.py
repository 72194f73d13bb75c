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
        **{"prefill_token_s": 0.0, **costs},
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
