"""The ``hf`` engine samples what transformers' ``model.generate`` samples, at the same settings, with the
generation config built the way TRL's GRPOTrainer builds it (issue 36, item 2).

Over many prompts of the embedded tiny model (its final norm scaled so that the next-token distributions are
peaked, as a trained model's are, instead of near-uniform), the engine's own loop and ``model.generate`` each draw
``DRAWS`` replies per prompt. Checked:

* first-token distribution: the mean over prompts of the total-variation distance between each sampler's counts
  and the exact distribution (the model's logits through transformers' own temperature / top-k / top-p warpers),
  and between the two samplers' counts. The thresholds are not guessed: ``null_quantile`` draws the same number
  of samples from the exact distribution ``REPLICATES`` times and puts the threshold ``Z_MAX`` standard
  deviations above the mean of the statistic under the hypothesis that both samplers follow it (a parametric
  bootstrap; the statistic is a mean over independent prompts, so close to normal).
  ``test_detects_a_wrong_temperature`` shows that the check fails a sampler at temperature x1.15.
* mean reply length and EOS rate: a two-sample z-score against ``generate``'s, its standard error computed from
  the samples' per-prompt variances; ``Z_MAX`` = 4.5 (a false alarm about once in 150,000 runs). So that replies
  both end and run to the budget, a token found in about half of a pilot's replies is a stop token besides EOS
  (``stop_token_ids``, which TRL's configuration takes as one more ``eos_token_id``).

The engine bans pad and bos inside replies unless ``sample_special_tokens=True`` (docs/engines.md, "Sampling");
the test runs both: with the flag, against TRL's configuration unchanged; without it, against ``generate`` with
those tokens in ``suppress_tokens`` (and shows that the ban is a real difference on this model).
"""

from __future__ import annotations

import os

import pytest
import torch

from gcore.engines.hf import HFEngine, ignored_generation_values
from gcore.model import ModelConfig, ModelSource, build_tiny_model, char_tokenizer
from gcore.types import SamplingParams

PROMPTS = 16
DRAWS = 256
MAX_NEW_TOKENS = 8
#: the bootstrap's replicates; the threshold is their mean + ``Z_MAX`` standard deviations (the statistic is a mean
#: over independent prompts, close to normal)
REPLICATES = 300
Z_MAX = 4.5


def trl_generation_config(model, tokenizer, *, temperature: float, top_p: float, top_k: int, max_new_tokens: int):
    """The ``GenerationConfig`` TRL 1.16's GRPOTrainer passes to ``model.generate`` (trl/trainer/grpo_trainer.py,
    the transformers path of ``__init__``: ``generation_kwargs``), with GRPOConfig's defaults min_p=None,
    repetition_penalty=1.0 and no ``generation_kwargs``. TRL also sets ``model.generation_config.pad_token_id`` to the
    tokenizer's and adds the tokenizer's EOS to the checkpoint's EOS ids. ``generate`` then fills the fields left
    ``None`` from the checkpoint's generation config, then from transformers' global defaults."""
    from transformers import GenerationConfig

    model.generation_config.pad_token_id = tokenizer.pad_token_id
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id not in eos:
        eos = [tokenizer.eos_token_id, *eos]
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, temperature=temperature,
                            top_p=top_p, top_k=top_k, min_p=None, repetition_penalty=1.0, cache_implementation=None,
                            disable_compile=True)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """The tiny model with its final norm x6: next-token distributions of a few likely tokens each."""
    tokenizer = char_tokenizer()
    model = build_tiny_model(ModelConfig(num_hidden_layers=2), tokenizer, seed=3)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    path = str(tmp_path_factory.mktemp("peaked"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rng = torch.Generator().manual_seed(0)
    prompts = [tokenizer.encode(f"{int(torch.randint(10**5, 10**6, (1,), generator=rng))}=", add_special_tokens=False)
               for _ in range(PROMPTS)]  # all of 7 tokens
    return path, tokenizer, prompts


def stop_token(model, prompts, config, banned: list[int]) -> int:
    """The token that ends about half of the replies when made a stop token: of a pilot of 32 ``generate`` replies
    per prompt (seeded apart from the compared ones), the token found in the share of replies nearest 0.5."""
    torch.manual_seed(7)
    ids = torch.tensor(prompts).repeat_interleave(32, dim=0)
    with torch.inference_mode():
        rows = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    replies = rows[:, ids.shape[1]:]
    share = torch.zeros(model.config.vocab_size)
    for token in replies.unique().tolist():
        share[token] = float((replies == token).any(-1).float().mean())
    share[[*banned, *config.eos_token_id]] = float("inf")
    return int((share - 0.5).abs().argmin())


def _model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def exact_first_token(model, prompts, config, banned: list[int]) -> torch.Tensor:
    """``[prompts, vocab]``: the first token's distribution as ``generate`` samples it (its own logits processors
    for ``config``), with ``banned`` tokens removed."""
    from transformers import LogitsProcessorList

    prepared, _ = model._prepare_generation_config(config)  # the checkpoint's values and the global defaults filled in
    processors = model._get_logits_processor(generation_config=prepared, input_ids_seq_length=1,
                                             encoder_input_ids=None, prefix_allowed_tokens_fn=None,
                                             logits_processor=LogitsProcessorList())
    rows = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logits = model(input_ids=ids).logits[:, -1].float()
            logits[:, banned] = float("-inf")
            rows.append(torch.softmax(processors(ids, logits), dim=-1)[0])
    return torch.stack(rows)


def mean_tv(counts: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean over prompts of the total-variation distance between count rows (normalised) and ``reference`` rows."""
    return float(0.5 * (counts / counts.sum(-1, keepdim=True) - reference).abs().sum(-1).mean())


def null_quantile(exact: torch.Tensor, draws: int, two_sample: bool, seed: int = 0) -> float:
    """The threshold of ``mean_tv`` when the counts are ``draws`` samples per prompt from ``exact`` (against
    ``exact``; ``two_sample``: two such independent samples against each other): its mean + ``Z_MAX`` standard
    deviations over ``REPLICATES`` replicates."""
    generator = torch.Generator().manual_seed(seed)
    prompts, vocab = exact.shape

    def counts() -> torch.Tensor:
        drawn = torch.multinomial(exact.repeat(REPLICATES, 1), draws, replacement=True, generator=generator)
        ones = torch.ones_like(drawn, dtype=torch.float)
        return torch.zeros(REPLICATES * prompts, vocab).scatter_add_(1, drawn, ones)

    a = counts().view(REPLICATES, prompts, vocab) / draws
    b = counts().view(REPLICATES, prompts, vocab) / draws if two_sample else exact.unsqueeze(0)
    stats = 0.5 * (a - b).abs().sum(-1).mean(-1)
    return float(stats.mean() + Z_MAX * stats.std())


def first_token_counts(replies: list[list[list[int]]], vocab: int) -> torch.Tensor:
    counts = torch.zeros(len(replies), vocab)
    for i, group in enumerate(replies):
        for reply in group:
            counts[i, reply[0]] += 1
    return counts


def length_stats(replies: list[list[list[int]]], eos: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt and reply: ``[prompts, draws]`` lengths (tokens up to and with the first EOS) and EOS flags."""
    lengths, ended = [], []
    for group in replies:
        row_l, row_e = [], []
        for reply in group:
            stop = next((i for i, t in enumerate(reply) if t in eos), None)
            row_l.append(len(reply) if stop is None else stop + 1)
            row_e.append(stop is not None)
        lengths.append(row_l)
        ended.append(row_e)
    return torch.tensor(lengths, dtype=torch.float64), torch.tensor(ended, dtype=torch.float64)


def z_score(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample z of the difference of the means of ``[prompts, draws]`` samples: the variance of each mean is
    the sum of the per-prompt variances over draws, over prompts squared (prompts are strata of equal size)."""
    def variance(x: torch.Tensor) -> float:
        return float(x.var(dim=1, unbiased=True).sum() / x.shape[1] / x.shape[0] ** 2)

    se = (variance(a) + variance(b)) ** 0.5
    return float((a.mean() - b.mean()) / se) if se > 0 else 0.0


def engine_replies(path: str, prompts, params: SamplingParams, sample_special_tokens: bool) -> list[list[list[int]]]:
    engine = HFEngine(sample_special_tokens=sample_special_tokens)
    engine.setup(ModelSource(path), torch.device("cpu"))
    try:
        torch.manual_seed(1)
        return [[g.token_ids for g in group] for group in engine.generate(prompts, params)]
    finally:
        engine.shutdown()


def generate_replies(model, prompts, config) -> list[list[list[int]]]:
    """``generate`` over every prompt at once (all of one length: no padding), ``DRAWS`` replies each; cut after
    the first EOS."""
    torch.manual_seed(2)
    eos = set(config.eos_token_id)
    ids = torch.tensor(prompts).repeat_interleave(DRAWS, dim=0)
    with torch.inference_mode():
        sequences = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    rows = sequences[:, ids.shape[1]:].tolist()
    out: list[list[list[int]]] = [[] for _ in prompts]
    for index, row in enumerate(rows):
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        out[index // DRAWS].append(row if stop is None else row[: stop + 1])
    return out


#: (temperature, top_p, top_k, sample_special_tokens): TRL's defaults with both choices of the flag, and top-p and
#: top-k each once
SETTINGS = [pytest.param(1.0, 1.0, 0, True, id="t1.0-special-sampled"),
            pytest.param(1.0, 1.0, 0, False, id="t1.0-special-banned"),
            pytest.param(0.7, 0.9, 0, False, id="t0.7-top_p0.9"),
            pytest.param(1.0, 1.0, 8, True, id="t1.0-top_k8")]


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "sample_special_tokens"), SETTINGS)
def test_hf_engine_samples_as_generate(peaked, temperature, top_p, top_k, sample_special_tokens):
    path, tokenizer, prompts = peaked
    model = _model(path)
    config = trl_generation_config(model, tokenizer, temperature=temperature, top_p=top_p, top_k=top_k,
                                   max_new_tokens=MAX_NEW_TOKENS)
    banned = [] if sample_special_tokens else [tokenizer.pad_token_id, tokenizer.bos_token_id]
    if banned:  # the engine's default: generate with the same tokens suppressed
        config.suppress_tokens = banned
    vocab = model.config.vocab_size
    exact = exact_first_token(model, prompts, config, banned)
    stop = stop_token(model, prompts, config, banned)
    config.eos_token_id = [*config.eos_token_id, stop]
    params = SamplingParams(n=DRAWS, max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_token_ids=(stop,))
    ours = engine_replies(path, prompts, params, sample_special_tokens)
    theirs = generate_replies(model, prompts, config)

    ours_counts, theirs_counts = first_token_counts(ours, vocab), first_token_counts(theirs, vocab)
    one_sample = null_quantile(exact, DRAWS, two_sample=False)
    two_sample = null_quantile(exact, DRAWS, two_sample=True)
    assert mean_tv(theirs_counts, exact) <= one_sample, "generate does not sample the computed distribution"
    assert mean_tv(ours_counts, exact) <= one_sample, (mean_tv(ours_counts, exact), one_sample)
    assert mean_tv(ours_counts, theirs_counts / DRAWS) <= two_sample, (mean_tv(ours_counts, theirs_counts / DRAWS),
                                                                       two_sample)

    eos = set(config.eos_token_id)
    ours_length, ours_eos = length_stats(ours, eos)
    theirs_length, theirs_eos = length_stats(theirs, eos)
    assert 0.2 < float(theirs_eos.mean()) < 0.8, "the check of the EOS rate needs replies that end and not"
    assert abs(z_score(ours_length, theirs_length)) <= Z_MAX, (ours_length.mean(), theirs_length.mean())
    assert abs(z_score(ours_eos, theirs_eos)) <= Z_MAX, (ours_eos.mean(), theirs_eos.mean())


def test_detects_a_wrong_temperature(peaked):
    """The check can fail: samples at temperature 1.15 are told apart from the distribution at 1.0."""
    path, tokenizer, prompts = peaked
    model = _model(path)
    config = trl_generation_config(model, tokenizer, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1)
    exact = exact_first_token(model, prompts, config, [])
    wrong = engine_replies(path, prompts, SamplingParams(n=DRAWS, max_new_tokens=1, temperature=1.15), True)
    assert mean_tv(first_token_counts(wrong, model.config.vocab_size), exact) > null_quantile(exact, DRAWS, False)


def test_banning_special_tokens_is_a_real_difference(peaked):
    """On this model pad and bos hold enough first-token mass that the default ban shows: what
    ``sample_special_tokens`` chooses is not a no-op (for SmolLM2, pad is EOS and only bos is banned)."""
    path, tokenizer, prompts = peaked
    model = _model(path)
    config = trl_generation_config(model, tokenizer, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1)
    exact = exact_first_token(model, prompts, config, [])
    special = exact[:, [tokenizer.pad_token_id, tokenizer.bos_token_id]].sum(-1)
    assert float(special.mean()) > 1e-3
    banned = engine_replies(path, prompts, SamplingParams(n=DRAWS, max_new_tokens=1), False)
    counts = first_token_counts(banned, model.config.vocab_size)
    assert counts[:, [tokenizer.pad_token_id, tokenizer.bos_token_id]].sum() == 0


def test_generation_config_values_the_engine_ignores(tmp_path, caplog):
    """A checkpoint whose generation config sets sampling values (as Qwen2.5-Instruct's does): the engine names
    them in a warning; transformers' unset fields and no-op values are not named."""
    from transformers import GenerationConfig

    assert ignored_generation_values(GenerationConfig(eos_token_id=2, pad_token_id=2, bos_token_id=1)) == {}
    assert ignored_generation_values(GenerationConfig(top_k=0, repetition_penalty=1.0, temperature=1.0)) == {}
    values = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert ignored_generation_values(values) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                 "repetition_penalty": 1.05}

    tokenizer = char_tokenizer()
    model = build_tiny_model(ModelConfig(num_hidden_layers=1), tokenizer, seed=0)
    model.generation_config.repetition_penalty = 1.1
    model.save_pretrained(str(tmp_path))
    engine = HFEngine()
    with caplog.at_level("WARNING", logger="gcore.engines.hf"):
        engine.setup(ModelSource(str(tmp_path)), torch.device("cpu"))
    engine.shutdown()
    assert "repetition_penalty=1.1" in caplog.text and os.fspath(tmp_path) in caplog.text
