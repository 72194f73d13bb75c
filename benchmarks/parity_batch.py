"""One recorded GRPO batch through gcore's update and through TRL 1.16's, gradient against gradient (issue 52).

Samples one step's batch (``--prompts`` prompts x ``--n`` replies of the ``number_only`` task, chat-formatted, at
``--temperature``, ``--max-new-tokens``) with gcore's HF engine from ``--model-path``, scores it with
``gcore.tasks.number_only_reward``, then computes on the SAME token ids:

- gcore: ``TorchBackend.train_mini_batch`` with ``GRPO(clip_eps=0.2, scale_rewards=True, kl_coef=0,
  loss_agg="seq_mean_token_mean")`` (the trainer's own path: shared prompts, packed replies, skipped inert rows);
- TRL: ``GRPOTrainer._compute_loss`` of TRL's own code (``loss_type="grpo"``, ``beta=0``, ``epsilon=0.2``,
  ``scale_rewards="group"``), fed what its ``_generate_and_score_completions`` would build from these ids: left-padded
  prompts, right-padded completions, the completion mask up to and including the first EOS, the advantages by TRL's
  formula;

and prints, per reply, its length, whether it ended in EOS, its reward and the two trainers' advantages, then the
gradient of every parameter tensor side by side (relative difference of the flattened gradient, cosine, norms) and
the per-token loss weights ``d loss / d logprob`` at the EOS and elsewhere. Needs TRL importable (the separate venv of
benchmarks/results/parity.md) next to gcore:

    PYTHONPATH=. /work/venv-trl/bin/python benchmarks/parity_batch.py --model-path /tmp/parity-smollm2-hf --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile


def tiny_batch(args: argparse.Namespace):
    """Without ``--model-path``: the embedded tiny model (2 layers, 32 wide, seed 5) and the hand-made batch of
    tests/algorithms/test_grpo_reference.py (replies ending in EOS, replies cut at the limit, a tied group)."""
    import sys

    from gcore.model import ModelConfig, char_tokenizer, materialize

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "algorithms"))
    from test_grpo_reference import MAX_NEW_TOKENS, _samples

    tokenizer = char_tokenizer()
    args.model_path = materialize(ModelConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64), tokenizer,
                                  5, tempfile.mkdtemp(prefix="parity-tiny-"))
    args.max_new_tokens, args.n, args.prompts = MAX_NEW_TOKENS, 3, 3
    return _samples(tokenizer), tokenizer


def sample_batch(args: argparse.Namespace):
    import torch

    if args.model_path is None:
        return tiny_batch(args)

    from gcore.data import DataConfig, load_eval_prompts
    from gcore.engines.hf import HFEngine
    from gcore.model import ModelConfig, ModelSource, load_tokenizer
    from gcore.tasks import number_only_reward
    from gcore.types import Sample, SamplingParams

    tokenizer = load_tokenizer(ModelConfig(path=args.model_path))
    data = DataConfig(task="number_only", chat_template=True, task_digits=(4, 4), num_eval_prompts=args.prompts)
    prompts = load_eval_prompts(data, tokenizer, args.max_new_tokens, None)
    torch.manual_seed(args.seed)
    engine = HFEngine()
    engine.setup(ModelSource(args.model_path), torch.device("cpu"))
    sampling = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              stop_token_ids=(tokenizer.eos_token_id,))
    try:
        outputs = engine.generate([p.token_ids for p in prompts], sampling)
    finally:
        engine.shutdown()
    samples = []
    for group, (prompt, generations) in enumerate(zip(prompts, outputs, strict=True)):
        for g in generations:
            text = tokenizer.decode(g.token_ids, skip_special_tokens=True)
            samples.append(Sample(prompt=prompt, group=group, response_ids=list(g.token_ids),
                                  response_logprobs=list(g.logprobs), response_text=text, finished=g.finished,
                                  reward=number_only_reward(text, str(prompt.answer))))
    return samples, tokenizer


def gcore_grads(args: argparse.Namespace, samples: list, tokenizer) -> tuple[dict, object, object]:
    import torch
    from lightning_fabric import Fabric

    from gcore import GRPO, TorchBackend
    from gcore.model import ModelSource
    from gcore.types import collate

    algorithm = GRPO(clip_eps=0.2, scale_rewards=True, kl_coef=0.0, loss_agg="seq_mean_token_mean")
    algorithm.setup(args.max_new_tokens)
    backend = TorchBackend(lr=2e-5, micro_batch_size=args.prompts * args.n)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(args.model_path), algorithm, embedded=args.tiny)
    batch = collate(samples, tokenizer.pad_token_id, args.temperature)
    batch.response_mask = algorithm.loss_mask(batch)
    batch.advantages = algorithm.advantages(batch)
    backend.train_mini_batch(batch, torch.arange(len(batch)), algorithm)
    grads = {name: p.grad.detach().clone() for name, p in backend.hf_model.named_parameters() if p.grad is not None}
    # the per-token loss weights d loss / d logprob on the same batch (logprobs as leaves: ratio 1)
    logprobs = batch.engine_logprobs.clone().requires_grad_(True)
    scale = algorithm.loss_scale(float(batch.response_mask.sum()), float(len(batch)))
    loss, _ = algorithm.loss(logprobs, batch, scale)
    loss.backward()
    return grads, batch, logprobs.grad


def trl_grads(args: argparse.Namespace, samples: list, tokenizer) -> tuple[dict, object, object]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="parity-trl-") as root:
        config = GRPOConfig(output_dir=os.path.join(root, "out"), use_cpu=True, seed=args.seed, max_steps=1,
                            per_device_train_batch_size=args.prompts * args.n, gradient_accumulation_steps=1,
                            num_generations=args.n, max_completion_length=args.max_new_tokens,
                            temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=2e-5,
                            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
                            num_iterations=1, scale_rewards="group", loss_type="grpo", report_to="none",
                            save_strategy="no", disable_tqdm=True)
        prompt = "x" if args.tiny else [{"role": "user", "content": "x"}]
        dataset = Dataset.from_list([{"prompt": prompt, "answer": "1"}] * args.n)
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=config, train_dataset=dataset, processing_class=tokenizer)
    pad, eos = tokenizer.pad_token_id, list(trainer.eos_token_ids)
    prompt_len = max(len(s.prompt.token_ids) for s in samples)
    width = max(len(s.response_ids) for s in samples)
    prompt_ids = torch.full((len(samples), prompt_len), pad, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(samples), width), pad, dtype=torch.long)
    for row, s in enumerate(samples):
        prompt_ids[row, prompt_len - len(s.prompt.token_ids):] = torch.tensor(s.prompt.token_ids)
        prompt_mask[row, prompt_len - len(s.prompt.token_ids):] = 1
        completion_ids[row, : len(s.response_ids)] = torch.tensor(s.response_ids)
    # TRL's mask (its transformers-generate path): every token up to and including the first EOS
    is_eos = torch.isin(completion_ids, torch.tensor(eos))
    eos_idx = torch.full((len(samples),), width, dtype=torch.long)
    eos_idx[is_eos.any(1)] = is_eos.int().argmax(1)[is_eos.any(1)]
    completion_mask = (torch.arange(width).expand(len(samples), -1) <= eos_idx.unsqueeze(1)).int()
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
    grouped = rewards.view(-1, args.n)
    mean = grouped.mean(1).repeat_interleave(args.n)
    std = grouped.std(1).repeat_interleave(args.n)
    advantages = (rewards - mean) / (std + 1e-4)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum()}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return grads, (completion_mask, advantages), loss.detach()


def reference_grads(args: argparse.Namespace, samples: list, advantages) -> dict:
    """The same loss in float64, row by row through plain unpadded forwards (prompt + reply, no padding, no packing,
    no shared prompt): ``-(1 / rows) sum_r A_r / |T_r| sum_t log p(t)`` at ratio 1 (where the clipped and the
    unclipped term agree, the gradient flows through the unclipped one). What both trainers' float32 gradients are
    measured against (``--reference``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float64)
    model.train()
    model.zero_grad()
    rows = len(samples)
    for row, s in enumerate(samples):
        ids = torch.tensor([list(s.prompt.token_ids) + list(s.response_ids)])
        logits = model(input_ids=ids).logits[0, :-1].double()
        logp = torch.log_softmax(logits / args.temperature, dim=-1)
        targets = ids[0, 1:]
        token_logp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)[len(s.prompt.token_ids) - 1 :]
        loss = -float(advantages[row]) * token_logp.mean() / rows
        loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def compare(a: dict, b: dict) -> tuple[float, float]:
    """Relative difference and cosine of two gradients (dicts of tensors), over the tensors both have."""
    import torch

    names = sorted(set(a) & set(b))
    fa = torch.cat([a[n].flatten().double() for n in names])
    fb = torch.cat([b[n].flatten().double() for n in names])
    cosine = fa @ fb / (fa.norm() * fb.norm()).clamp(min=1e-30)
    return float((fa - fb).norm() / fb.norm().clamp(min=1e-30)), float(cosine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="an HF checkpoint folder (default: the tiny embedded "
                        "model and the hand-made batch of tests/algorithms/test_grpo_reference.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--json", help="write the per-reply and per-tensor figures here")
    parser.add_argument("--reference", action="store_true", help="also compute the loss's gradient in float64 through "
                        "plain per-row forwards and measure each trainer's float32 gradient against it")
    parser.add_argument("--no-trl", action="store_true", help="gcore (and --reference) only: no TRL needed")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    args.tiny = args.model_path is None
    samples, tokenizer = sample_batch(args)
    g_grads, batch, weights = gcore_grads(args, samples, tokenizer)
    if args.reference:
        ref = reference_grads(args, samples, batch.advantages)
        rel, cos = compare(g_grads, ref)
        print(f"gcore float32 against the float64 reference: relative difference {rel:.3g}, cosine {cos:.8f}")
        args.gcore_vs_reference = [rel, cos]
    if args.no_trl:
        return
    t_grads, (t_mask, t_adv), _ = trl_grads(args, samples, tokenizer)
    if args.reference:
        rel, cos = compare(t_grads, ref)
        print(f"TRL float32 against the float64 reference: relative difference {rel:.3g}, cosine {cos:.8f}")
        args.trl_vs_reference = [rel, cos]
    replies = []
    print("reply  tokens  eos  reward  adv_gcore  adv_trl  gcore_mask_tokens  trl_mask_tokens  "
          "weight_at_last_token(gcore)  text")
    for row, s in enumerate(samples):
        g_tokens = int(batch.response_mask[row].sum())
        t_tokens = int(t_mask[row].sum())
        p = len(s.prompt.token_ids)
        last = float(weights[row, p + len(s.response_ids) - 2])
        replies.append({"tokens": len(s.response_ids), "eos": s.finished, "reward": s.reward,
                        "adv_gcore": float(batch.advantages[row]), "adv_trl": float(t_adv[row]),
                        "mask_gcore": g_tokens, "mask_trl": t_tokens, "weight_last": last, "text": s.response_text})
        print(f"{row:5d}  {len(s.response_ids):6d}  {int(s.finished):3d}  {s.reward:6.2f}  "
              f"{float(batch.advantages[row]):+9.4f}  {float(t_adv[row]):+7.4f}  {g_tokens:17d}  {t_tokens:15d}  "
              f"{last:+27.5f}  {s.response_text[:60]!r}")
    names = sorted(set(g_grads) | set(t_grads))
    flat_g = torch.cat([g_grads[n].flatten().double() for n in names if n in g_grads and n in t_grads])
    flat_t = torch.cat([t_grads[n].flatten().double() for n in names if n in g_grads and n in t_grads])
    rel = float((flat_g - flat_t).norm() / flat_t.norm().clamp(min=1e-30))
    cos = float(flat_g @ flat_t / (flat_g.norm() * flat_t.norm()).clamp(min=1e-30))
    only = [n for n in names if (n in g_grads) != (n in t_grads)]
    worst = max(((float((g_grads[n] - t_grads[n]).norm() / t_grads[n].norm().clamp(min=1e-30)), n)
                 for n in names if n in g_grads and n in t_grads), default=(math.nan, ""))
    print(f"\nwhole gradient: gcore norm {float(flat_g.norm()):.6g}, TRL norm {float(flat_t.norm()):.6g}, "
          f"relative difference {rel:.3g}, cosine {cos:.8f}; worst tensor {worst[1]} ({worst[0]:.3g}); "
          f"tensors with a gradient in one trainer only: {only or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "replies": replies, "grad_norm_gcore": float(flat_g.norm()),
                       "grad_norm_trl": float(flat_t.norm()), "relative_difference": rel, "cosine": cos,
                       "worst_tensor": worst[1], "worst_relative_difference": worst[0], "one_side_only": only}, f,
                      indent=1)


if __name__ == "__main__":
    main()
