"""gcore's training-inference mismatch corrections against TRL's vLLM importance-sampling correction, same tensors.

    PYTHONPATH=. /work/venv-trl/bin/python benchmarks/mismatch_vs_trl.py --seed 0

Any Python with torch, gcore and TRL (1.16 was compared) runs it. TRL has no function for the correction: it
computes it inline in ``GRPOTrainer._generate_and_score_completions``. This script runs that very block of TRL's
installed source (found between its two comments, executed with the tensors and a stand-in for the trainer's
options; nothing of it is copied here), so a change in TRL shows up as a difference, and gcore's correction
through ``Algorithm.correct_mismatch`` (the path the loss takes, the ratio built from the batch's log-probs).

The tensors: 64 replies of 1 to 48 tokens (right padding, the padding's engine log-probs left as noise), the
trainer's log-probs minus the engine's normal with std 0.3, and 5 % of the tokens pushed by +-3 (ratios far
outside every bound). Prints, per mode and bounds, the max abs difference of the per-token weights over the reply
tokens and the number of reply tokens whose weight is 0 on each side (the masked ones).
"""

from __future__ import annotations

import argparse
import inspect
import math
import platform
import textwrap
import types

import torch

from gcore import GRPO
from gcore.types import RolloutBatch

START = "# Compute the importance sampling ratio when using vLLM"
END = "# Compute the per-token log probabilities for the reference model"


def trl_block() -> types.CodeType:
    """TRL's inline correction, compiled from its installed ``grpo_trainer.py``."""
    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer)
    start = source.rindex("\n", 0, source.index(START)) + 1  # from the start of the comment's line
    end = source.index(END, start)
    return compile(textwrap.dedent(source[start:end]), grpo_trainer.__file__, "exec")


def trl_weights(block: types.CodeType, trainer_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor,
                mode: str, low: float | None, high: float | None) -> torch.Tensor:
    options = types.SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                                    vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=low,
                                    vllm_importance_sampling_clip_max=high)
    scope = {"self": options, "torch": torch, "math": math, "completion_mask": mask, "tool_mask": None,
             "old_per_token_logps": trainer_lp, "sampling_per_token_logps": engine_lp}
    exec(block, scope)  # TRL's own code, from its installed package
    return scope["vllm_importance_sampling_ratio"].expand_as(mask)


def gcore_weights(trainer_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor, mode: str,
                  low: float | None, high: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight ``Algorithm.correct_mismatch`` puts on a per-token loss of 1, and its masked/truncated share."""
    rows = len(mask)
    batch = RolloutBatch(input_ids=torch.zeros(rows, mask.shape[1] + 1, dtype=torch.long),
                         attention_mask=torch.ones(rows, mask.shape[1] + 1, dtype=torch.long), response_mask=mask,
                         rewards=torch.zeros(rows), group_ids=torch.zeros(rows, dtype=torch.long),
                         engine_logprobs=engine_lp)
    algorithm = GRPO(mismatch_correction=mode, mismatch_low=low, mismatch_high=high)
    weighted, diagnostics = algorithm.correct_mismatch(torch.ones_like(mask), trainer_lp, batch)
    return weighted, diagnostics["mismatch/masked_frac"]


def tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    rows, width = 64, 48
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width) < lengths[:, None]).float()
    trainer_lp = -torch.rand(rows, width, generator=generator) * 4
    log_ratio = torch.randn(rows, width, generator=generator) * 0.3
    outliers = torch.rand(rows, width, generator=generator) < 0.05
    log_ratio = log_ratio + outliers * torch.where(torch.rand(rows, width, generator=generator) < 0.5, 3.0, -3.0)
    engine_lp = trainer_lp - log_ratio
    noise = -torch.rand(rows, width, generator=generator) * 20  # what the padding holds must not matter
    engine_lp = torch.where(mask > 0, engine_lp, noise)
    return trainer_lp, engine_lp, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import trl

    print(f"torch {torch.__version__}, trl {trl.__version__}, python {platform.python_version()}, seed {args.seed}")
    block = trl_block()
    trainer_lp, engine_lp, mask = tensors(args.seed)
    # sequence products of 48 ratios are far from 1: the sequence modes also run on the first 4 tokens of each reply
    short = mask * (torch.arange(mask.shape[1]) < 4).float()
    cases = [(m, low, high, name, msk) for m in ("token_truncate", "token_mask")
             for low, high in ((None, 2.0), (0.5, 3.0)) for name, msk in (("all", mask),)]
    cases += [(m, low, high, name, msk) for m in ("sequence_truncate", "sequence_mask")
              for low, high in ((None, 2.0), (0.5, 3.0)) for name, msk in (("all", mask), ("first 4", short))]
    print(f"{'mode':<18} {'low':>5} {'high':>5} {'tokens':>8} {'max |w_gcore - w_trl|':>22} "
          f"{'zero w gcore':>12} {'zero w trl':>10} {'corrected share':>15}")
    for mode, low, high, name, msk in cases:
        ours, corrected = gcore_weights(trainer_lp, engine_lp, msk, mode, low, high)
        theirs = trl_weights(block, trainer_lp, engine_lp, msk, mode, low, high)
        on = msk > 0
        diff = (ours[on] - theirs[on]).abs().max().item()
        print(f"{mode:<18} {low!s:>5} {high!s:>5} {name:>8} {diff:>22.3g} {int((ours[on] == 0).sum()):>12} "
              f"{int((theirs[on] == 0).sum()):>10} {corrected[on].mean().item():>15.4f}")
    # a control: the harness sees a difference where there is one (gcore's cap 2 against TRL's default cap 3)
    ours, _ = gcore_weights(trainer_lp, engine_lp, mask, "token_truncate", None, 2.0)
    theirs = trl_weights(block, trainer_lp, engine_lp, mask, "token_truncate", None, 3.0)
    print(f"control: token_truncate high 2.0 (gcore) against 3.0 (TRL): max |diff| "
          f"{(ours[mask > 0] - theirs[mask > 0]).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
