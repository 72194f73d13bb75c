"""gcore's on-policy distillation signal against TRL's reverse KL (``GKDTrainer.generalized_jsd_loss``, beta=1).

    PYTHONPATH=. OMP_NUM_THREADS=1 /work/venv-trl/bin/python benchmarks/distill_vs_trl.py --seed 0

Any Python with torch, gcore and TRL (1.16 was compared) runs it. What is comparable: TRL's GKD loss with
``beta=1`` is the reverse KL ``KL(student || teacher)`` computed exactly from the two full distributions at each
position; gcore's signal is the one-sample estimate at the token the student sampled,
``log pi_s(t) - log pi_t(t)`` (the negative of ``Distill.advantages``). So the script checks, on random float64
logits (batch 8, 24 positions, vocabulary 512, a 25 % masked tail; the student and teacher logits normal with std
2, the teacher's correlated with the student's):

1. the expectation of gcore's per-token estimate over the student's distribution (every vocabulary token taken as
   the sampled one, through ``Distill.advantages``, weighted by its probability) against TRL's per-token reverse KL;
2. the gradient of gcore's loss in expectation (``Distill.policy_loss``, GRPO's clipped surrogate at ratio 1, each
   token weighted by its detached probability) against the gradient of TRL's loss, both w.r.t. the student logits;
3. the Monte Carlo estimate from N tokens sampled from the student per position (N = 1 ... 4096) against TRL's,
   whose error falls as 1 / sqrt(N): the sampled signal is unbiased, not equal.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile

import torch

from gcore import Distill
from gcore.testing import make_batch, set_up


def tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, positions, vocabulary = 8, 24, 512
    student = torch.randn(batch, positions, vocabulary, generator=generator, dtype=torch.float64) * 2
    teacher = 0.6 * student + 0.8 * torch.randn(batch, positions, vocabulary, generator=generator,
                                                dtype=torch.float64) * 2
    mask = torch.ones(batch, positions, dtype=torch.bool)
    mask[:, positions * 3 // 4:] = False  # a padded tail, ignored by both
    return student, teacher, mask


def trl_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's per-token ``generalized_jsd_loss`` with beta=1 (reduction ``none``, summed over the vocabulary)."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    labels = torch.where(mask, 0, -100)
    per_vocab = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=1.0, reduction="none")
    return per_vocab.sum(-1)  # [masked tokens]


def gcore_expected(algorithm: Distill, student: torch.Tensor, teacher: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per masked position: E_{t ~ student}[log pi_s(t) - log pi_t(t)] from ``Distill.advantages`` and the expected
    loss ``E_t[policy_loss(t)]`` (with the gradient of the loss gcore trains on, flowing to ``student``)."""
    student_lp, teacher_lp = student.log_softmax(-1)[mask], teacher.log_softmax(-1)[mask]  # [N, V]
    rows, vocabulary = student_lp.shape
    # each row of this batch is one position; its V "tokens" are every vocabulary token taken as the sampled one
    batch = make_batch([0.0] * rows, list(range(rows)), length=vocabulary + 1)
    batch.response_mask = torch.ones(rows, vocabulary, dtype=torch.float64)
    batch.engine_logprobs = student_lp.detach()
    batch.teacher_logprobs = teacher_lp
    batch.advantages = algorithm.advantages(batch)
    probs = student_lp.exp().detach()
    estimate = (probs * -batch.advantages).sum(-1)
    loss, _ = algorithm.policy_loss(student_lp, batch)
    return estimate, (probs * loss).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import trl

    print(f"torch {torch.__version__}, trl {trl.__version__}, python {platform.python_version()}, seed {args.seed}")
    student, teacher, mask = tensors(args.seed)
    with tempfile.TemporaryDirectory() as checkpoint:  # Distill checks that its teacher is a checkpoint directory
        open(os.path.join(checkpoint, "config.json"), "w").close()
        algorithm = set_up(Distill(teacher=checkpoint), 1)

        student_trl = student.clone().requires_grad_(True)
        theirs = trl_reverse_kl(student_trl, teacher, mask)
        theirs.sum().backward()
        student_gcore = student.clone().requires_grad_(True)
        ours, expected_loss = gcore_expected(algorithm, student_gcore, teacher, mask)
        expected_loss.sum().backward()
        assert student_trl.grad is not None and student_gcore.grad is not None
        print(f"positions {int(mask.sum())} (of {mask.numel()}), vocabulary {student.shape[-1]}, "
              f"mean reverse KL (TRL) {theirs.mean().item():.4f}")
        diff = (ours - theirs).abs()
        print(f"1. per-token reverse KL, E_student[gcore's estimate] vs TRL beta=1: max |diff| "
              f"{diff.max().item():.3g} (relative {(diff / theirs).max().item():.3g})")
        ours_grad, trl_grad = student_gcore.grad, student_trl.grad
        print(f"2. gradient w.r.t. the student logits, gcore's loss in expectation vs TRL's: max |diff| "
              f"{(ours_grad - trl_grad).abs().max().item():.3g} (max |grad| {trl_grad.abs().max().item():.3g}); "
              f"padded positions' gradient: gcore {ours_grad[~mask].abs().max().item():.3g}, "
              f"TRL {trl_grad[~mask].abs().max().item():.3g}")

        # a control: the harness sees a difference where there is one (TRL's beta=0, the forward KL(teacher||student))
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

        forward = GKDTrainer.generalized_jsd_loss(student, teacher, labels=torch.where(mask, 0, -100), beta=0.0,
                                                  reduction="none").sum(-1)
        print(f"control: gcore's expectation vs TRL beta=0 (forward KL): max |diff| "
              f"{(ours.detach() - forward).abs().max().item():.3g}")

        # 3. the sampled estimate, as the trainer uses it: N tokens per position drawn from the student
        student_lp, teacher_lp = student.log_softmax(-1)[mask], teacher.log_softmax(-1)[mask]
        generator = torch.Generator().manual_seed(args.seed + 1)
        print(f"3. {'N':>5} {'mean |estimate - TRL|':>22} {'max |estimate - TRL|':>21} {'|mean over positions|':>22}")
        for n in (1, 16, 256, 4096):
            tokens = torch.multinomial(student_lp.exp(), n, replacement=True, generator=generator)  # [N, n]
            rows = len(tokens)
            batch = make_batch([0.0] * rows, list(range(rows)), length=n + 1)
            batch.response_mask = torch.ones(rows, n, dtype=torch.float64)
            batch.engine_logprobs = student_lp.gather(-1, tokens)
            batch.teacher_logprobs = teacher_lp.gather(-1, tokens)
            estimate = (-algorithm.advantages(batch)).mean(-1)
            error = (estimate - theirs.detach())
            print(f"   {n:>5} {error.abs().mean().item():>22.4f} {error.abs().max().item():>21.4f} "
                  f"{error.mean().abs().item():>22.4f}")


if __name__ == "__main__":
    main()
