"""gcore's GRPO update against a reference implementation of the same loss, token by token (issue 52).

The batch is built to show what a trainer can get wrong at the end of a reply: replies that end in the EOS token
(which must carry the gradient, as TRL's completion mask holds the first EOS), replies cut at the token limit with no
EOS (every token counts, nothing is dropped), replies of different lengths (right padding after them, which must
carry nothing), a group whose rewards tie (no gradient, but it still counts in the sequence mean) and prompts of
different lengths. The reference is written from the formulas (TRL 1.16's ``_compute_loss`` with ``loss_type="grpo"``,
``beta=0``): each row on its own through a plain forward, ``A = (r - mean_group) / (std_group + eps)`` (Bessel-
corrected std), ``loss = mean over rows of (sum over the row's tokens of -A * ratio) / (the row's token count)``.
"""

from __future__ import annotations

import pytest
import torch

from gcore import GRPO, TorchBackend
from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize
from gcore.testing import set_up
from gcore.types import Prompt, Sample, collate

MAX_NEW_TOKENS = 6
TEMPERATURE = 0.7


def _samples(tokenizer) -> list[Sample]:
    """Three groups of three replies: EOS-ended replies of several lengths, replies cut at ``MAX_NEW_TOKENS`` (no
    EOS), and one group whose rewards tie."""
    eos = tokenizer.eos_token_id
    ids = lambda text: [ord(c) % 60 + 4 for c in text]  # noqa: E731  ids of the embedded model's vocabulary
    groups = [
        ("12+1=", [(ids("13"), True, 1.0), (ids("12+1=1"), False, 0.0), (ids("1"), True, 0.1)]),
        ("What is 7?", [(ids("7 is 7"), False, 0.0), (ids("77"), True, 0.1), (ids("7"), True, 1.0)]),
        ("9=", [(ids("99"), True, 0.1), (ids("9"), True, 0.1), (ids("999"), True, 0.1)]),  # tied: inert
    ]
    samples = []
    for group, (prompt_text, replies) in enumerate(groups):
        prompt = Prompt(group, prompt_text, ids(prompt_text), None, "<test>")
        for response, finished, reward in replies:
            response = response + [eos] if finished else (response * MAX_NEW_TOKENS)[:MAX_NEW_TOKENS]
            samples.append(Sample(prompt=prompt, group=group, response_ids=response,
                                  response_logprobs=[0.0] * len(response), response_text="", finished=finished,
                                  reward=reward))
    return samples


def _reference_advantages(samples: list[Sample], eps: float) -> list[float]:
    out = []
    for s in samples:
        rewards = torch.tensor([o.reward for o in samples if o.group == s.group], dtype=torch.float64)
        std = rewards.std() if float(rewards.max() - rewards.min()) > 0 else torch.tensor(0.0, dtype=torch.float64)
        out.append(0.0 if std == 0 else float((s.reward - rewards.mean()) / (std + eps)))
    return out


def _reference_mask(sample: Sample, eos: int) -> list[float]:
    """TRL's completion mask: every reply token up to and including the first EOS; all of a reply cut short."""
    first = next((i for i, t in enumerate(sample.response_ids) if t == eos), len(sample.response_ids) - 1)
    return [1.0 if i <= first else 0.0 for i in range(len(sample.response_ids))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = char_tokenizer()
    model_dir = materialize(ModelConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64), tokenizer, 5,
                            str(tmp_path_factory.mktemp("grpo-reference")))
    return tokenizer, model_dir


def _reference_update(model_dir: str, samples: list[Sample], eos: int, eps: float):
    """The reference loss's parameter gradients, per-token weights ``d loss / d logprob`` (per row, over its
    reply) and gradients w.r.t. the logits (per row, over its reply), each row through its own unpadded forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    advantages = _reference_advantages(samples, eps)
    total = 0.0
    weights, logit_grads = [], []
    for s, advantage in zip(samples, advantages, strict=True):
        ids = torch.tensor([s.prompt.token_ids + s.response_ids])
        p = len(s.prompt.token_ids)
        logits = model(input_ids=ids[:, :-1]).logits[0, p - 1:].float() / TEMPERATURE
        leaf = logits.detach().requires_grad_(True)
        logprobs = torch.log_softmax(leaf, -1).gather(-1, ids[0, p:].unsqueeze(-1)).squeeze(-1)
        lp = logprobs.detach().requires_grad_(True)
        mask = torch.tensor(_reference_mask(s, eos))
        ratio = torch.exp(lp - lp.detach())
        row_loss = (-advantage * ratio * mask).sum() / mask.sum().clamp(min=1.0) / len(samples)
        row_loss.backward()
        weights.append(lp.grad.clone())
        logprobs.backward(lp.grad)
        logit_grads.append(leaf.grad.clone())
        (logits * leaf.grad).sum().backward()  # the same gradient into the weights
        total += float(row_loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, weights, logit_grads, total


def test_grpo_update_equals_the_reference_token_by_token(tiny):
    tokenizer, model_dir = tiny
    samples = _samples(tokenizer)
    eos = tokenizer.eos_token_id
    algorithm = set_up(GRPO(clip_eps=0.2, scale_rewards=True, kl_coef=0.0, loss_agg="seq_mean_token_mean"),
                       MAX_NEW_TOKENS)
    batch = collate(samples, tokenizer.pad_token_id, TEMPERATURE)
    batch.response_mask = algorithm.loss_mask(batch)
    batch.advantages = algorithm.advantages(batch)
    assert batch.truncated is not None and int(batch.truncated.sum()) == 2  # two replies cut at the limit
    reference_grads, reference_weights, reference_logit_grads, _ = _reference_update(model_dir, samples, eos, 1e-6)

    # the advantages, and the tokens that carry the loss: the EOS included, the padding after a reply excluded
    assert torch.allclose(batch.advantages.double(), torch.tensor(_reference_advantages(samples, 1e-6),
                                                                  dtype=torch.float64), atol=1e-6)
    for row, s in enumerate(samples):
        p, r = len(s.prompt.token_ids), len(s.response_ids)
        expected = torch.zeros(batch.response_mask.shape[1])
        expected[p - 1: p - 1 + r] = torch.tensor(_reference_mask(s, eos))
        assert torch.equal(batch.response_mask[row], expected), f"row {row}: loss mask"

    # the per-token loss weights d loss / d logprob, and the gradient w.r.t. the logits, on the padded batch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(input_ids=batch.input_ids[:, :-1], attention_mask=batch.attention_mask[:, :-1]).logits.detach()
    leaf = (logits / TEMPERATURE).requires_grad_(True)
    logprobs = torch.log_softmax(leaf, -1).gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    lp = logprobs.detach().requires_grad_(True)
    scale = algorithm.loss_scale(float(batch.response_mask.sum()), float(len(batch)))
    loss, _ = algorithm.loss(lp, batch, scale)
    loss.backward()
    logprobs.backward(lp.grad)
    eos_weights = 0
    for row, s in enumerate(samples):
        p, r = len(s.prompt.token_ids), len(s.response_ids)
        ours = lp.grad[row]
        assert torch.allclose(ours[p - 1: p - 1 + r], reference_weights[row], atol=1e-7), f"row {row}: weights"
        assert not ours[: p - 1].any() and not ours[p - 1 + r:].any(), f"row {row}: weight off the reply"
        assert torch.allclose(leaf.grad[row, p - 1: p - 1 + r], reference_logit_grads[row], atol=1e-7), \
            f"row {row}: gradient w.r.t. the logits"
        assert not leaf.grad[row, p - 1 + r:].any(), f"row {row}: gradient w.r.t. the padding's logits"
        if s.finished and batch.advantages[row] != 0:
            assert ours[p - 2 + r] != 0  # the EOS carries the gradient
            eos_weights += 1
        if not s.finished:  # cut at the limit: every token weighs the same, -A / (tokens x rows)
            assert torch.allclose(ours[p - 1: p - 1 + r], torch.full((r,), -float(batch.advantages[row]) / r / 9))
    assert eos_weights == 4

    # the trainer's own update (shared prompts, packed replies, the tied group skipped): the same parameter gradient
    backend = TorchBackend(lr=1e-3, micro_batch_size=4)
    backend.setup(__import__("lightning_fabric").Fabric(accelerator="cpu", devices=1), ModelSource(model_dir),
                  algorithm, embedded=True)
    backend.train_mini_batch(batch, torch.arange(len(batch)), algorithm)
    ours = {name: p.grad for name, p in backend.hf_model.named_parameters() if p.grad is not None}
    assert ours.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        assert grad.abs().max() > 0 or name.endswith("bias")
        assert torch.allclose(ours[name], grad, rtol=1e-4, atol=1e-7), f"{name}: parameter gradient"
