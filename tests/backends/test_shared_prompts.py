"""Each distinct prompt run once: the same log-probabilities, entropies and gradients as the plain forward."""

import warnings

import pytest
import torch
from conftest import assert_same_run

from gcore.backends import sequence_parallel as seqpar
from gcore.backends import token_logprobs
from gcore.backends.shared_prompts import (
    distinct_prompts,
    packed_response_logits,
    packing_saves,
    shared_prompt_logits,
    to_batch_layout,
    to_response_layout,
)
from gcore.model import ModelConfig, build_tiny_model, char_tokenizer
from gcore.types import Prompt, Sample, collate

# float32 on CPU: the two forwards add the same terms in another order
ATOL = 2e-5


def _samples(tokenizer):
    """Prompts of different lengths, each with several responses of different lengths (one of them 1)."""
    torch.manual_seed(0)
    prompts = ["7=", "12+3=", "x"]
    responses = {"7=": [5, 1, 9], "12+3=": [4, 4], "x": [2, 6, 3, 7]}
    samples = []
    for index, text in enumerate(prompts):
        ids = tokenizer(text)["input_ids"]
        prompt = Prompt(index=index, text=text, token_ids=ids)
        for length in responses[text]:
            response = torch.randint(5, 40, (length,)).tolist()
            samples.append(Sample(prompt=prompt, group=index, response_ids=response, response_logprobs=[0.0] * length,
                                  response_text="", finished=False))
    samples.append(Sample(prompt=Prompt(index=9, text="9=", token_ids=tokenizer("9=")["input_ids"]), group=9,
                          response_ids=[8, 8, 8], response_logprobs=[0.0] * 3, response_text="", finished=False))
    return samples[::-1][1:] + samples[-1:]  # rows of one prompt need not be adjacent


@pytest.mark.parametrize("layout", ["padded", "packed", "packed-eager"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_shared_prompt_forward_equals_the_plain_forward(family, layout):
    """Padded: the responses right-padded to the longest; packed: one sequence without padding under a block mask
    (``packed_response_logits``; the mask is boolean for SDPA, added to the scores for eager attention)."""
    tokenizer = char_tokenizer()
    model = build_tiny_model(ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128), tokenizer, 0)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    batch = collate(_samples(tokenizer), tokenizer.pad_token_id, temperature=0.7)
    mask = batch.response_mask
    shared = distinct_prompts(batch)
    assert shared is not None and len(shared[0]) == 4  # 4 distinct prompts for 10 rows

    model.zero_grad()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    plain, plain_entropy = token_logprobs(logits, batch.input_ids, 0.7)
    (plain * mask * torch.linspace(0.5, 2.0, mask.shape[1])).sum().backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    if layout == "padded":
        logits, targets = shared_prompt_logits(model, batch, *shared, torch.device("cpu"))
        logprobs, entropy = seqpar.next_token_logprobs(logits, targets, 0.7)
    else:
        if layout == "packed-eager":
            model.config._attn_implementation = "eager"
        logits, targets, rows, columns = packed_response_logits(model, batch, *shared, torch.device("cpu"))
        assert len(targets) == int(mask.sum())  # one logit per response token: no padding ran
        logprobs, entropy = seqpar.next_token_logprobs(logits, targets, 0.7)
        logprobs, entropy = (to_response_layout(v, rows, columns, len(batch)) for v in (logprobs, entropy))
    logprobs, entropy = to_batch_layout(logprobs, batch), to_batch_layout(entropy, batch)
    (logprobs * mask * torch.linspace(0.5, 2.0, mask.shape[1])).sum().backward()

    assert logprobs.shape == plain.shape
    torch.testing.assert_close(logprobs * mask, plain * mask, atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy * mask, plain_entropy * mask, atol=ATOL, rtol=0)
    assert (logprobs * mask).abs().sum() > 1  # the comparison is not between zeros
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, plain_grads[name], atol=ATOL, rtol=1e-4, msg=name)


def test_packing_is_chosen_where_it_does_fewer_multiply_adds():
    """Short responses of uneven lengths: packing saves the padding; long ones: its one attention block over the
    whole micro-batch costs more than the padding it saves."""
    tokenizer = char_tokenizer()
    model = build_tiny_model(ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128), tokenizer, 0)

    def batch_of(lengths):
        prompt = Prompt(index=0, text="12+3=", token_ids=tokenizer("12+3=")["input_ids"])
        samples = [Sample(prompt=prompt, group=0, response_ids=[7] * n, response_logprobs=[0.0] * n,
                          response_text="", finished=True) for n in lengths]
        return collate(samples, tokenizer.pad_token_id, temperature=1.0)

    assert packing_saves(batch_of([2, 3, 24, 4, 5, 3, 2, 6]), 1, model.config)
    assert not packing_saves(batch_of([2000, 1990, 2010, 2005, 1995, 2000, 2001, 1999]), 1, model.config)


def test_packing_needs_sdpa_or_eager_attention_without_sliding_windows():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config

    from gcore.backends.shared_prompts import packed_attention

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    llama = LlamaForCausalLM(LlamaConfig(**small))
    assert packed_attention(llama) == "bool"
    llama.config._attn_implementation = "eager"
    assert packed_attention(llama) == "float"
    llama.config._attn_implementation = "flex_attention"
    assert packed_attention(llama) is None
    assert packed_attention(MistralForCausalLM(MistralConfig(sliding_window=16, **small))) is None
    qwen = build_tiny_model(ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128),
                            char_tokenizer(), 0)
    assert isinstance(qwen.config, Qwen2Config) and packed_attention(qwen) == "bool"  # its window is switched off
    qwen.config.layer_types = ["sliding_attention", "full_attention"]
    assert packed_attention(qwen) is None


def test_nothing_to_share_falls_back():
    tokenizer = char_tokenizer()
    samples = [s for s in _samples(tokenizer) if s.group in (0, 9)][:1] + [
        s for s in _samples(tokenizer) if s.group == 9]
    batch = collate(samples, tokenizer.pad_token_id, temperature=1.0)
    assert distinct_prompts(batch) is None  # every prompt distinct
    batch.prompt_lengths = None
    assert distinct_prompts(batch) is None  # a batch that does not say where its prompts end


def test_training_with_shared_prompts_gives_the_same_run():
    """Through the trainer (old and reference log-probabilities and the update all use the shared
    forward): the same rewards, losses and final weights as without sharing."""
    from gcore import GRPO, TorchBackend
    from gcore.testing import tiny_fit

    with warnings.catch_warnings():  # the cache goes by the keyword transformers takes, also through Fabric's wrapper
        warnings.simplefilter("error", FutureWarning)
        results = {share: tiny_fit(steps=3, save_final=True,
                                   backend=TorchBackend(share_prompts=share, micro_batch_size=6),
                                   algorithm=GRPO(kl_coef=0.05, epochs=2))
                   for share in (True, False)}
    assert_same_run(results[True], results[False])


def test_training_with_packed_responses_gives_the_same_run(monkeypatch):
    """The packed responses through the trainer: the same rewards, losses and final weights as padded ones."""
    from gcore import GRPO, TorchBackend
    from gcore.backends.torch import forward as torch_backend  # the module that calls it
    from gcore.testing import tiny_fit

    calls = []
    packed = torch_backend.packed_response_logits
    monkeypatch.setattr(torch_backend, "packed_response_logits", lambda *a, **k: calls.append(1) or packed(*a, **k))
    results = {pack: tiny_fit(steps=3, save_final=True,
                              backend=TorchBackend(share_prompts=True, pack_responses=pack, micro_batch_size=6),
                              algorithm=GRPO(kl_coef=0.05, epochs=2))
               for pack in (True, False)}
    assert calls  # the packed run ran packed
    assert_same_run(results[True], results[False])


@pytest.mark.integration
@pytest.mark.slow
def test_ranks_that_decide_differently_still_train_together(tmp_path, gcore_cli):
    """Two controllers where one shares its prompt (30 characters: half its tokens saved) and the other
    does not (2 characters: under a tenth), and where a controller whose groups all tied has no row to
    train: each micro-batch still makes one call through the DDP wrapper on both, and both reduce the
    same metrics, so their collectives match (a mismatch aborts in gloo: it did for both)."""
    import json

    rows = [{"prompt": "1" * 29 + "=", "answer": "1"}, {"prompt": "7=", "answer": "7"}] * 4
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    result = gcore_cli("--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.collective_timeout", "60",
                       "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
                       "--data.path", str(tmp_path / "d.jsonl"), "--data.shuffle", "false",
                       "--data.prompts_per_step", "2", "--sampling.n", "4", "--sampling.max_new_tokens", "16",
                       "--model.num_hidden_layers", "1", "--model.hidden_size", "32", "--model.intermediate_size", "64",
                       fast=False, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
