"""Whether an engine samples what transformers' ``model.generate`` samples, at the same settings, with the
generation config built the way TRL's GRPOTrainer builds it (issue 36, item 2): the one check that
test_hf_sampling.py, test_vllm_sampling.py and test_sglang_sampling.py run on their engines.

Over many prompts of the embedded tiny model (its final norm scaled so that the next-token distributions are
peaked, as a trained model's are, instead of near-uniform), the engine and ``model.generate`` each draw
``DRAWS`` replies per prompt. Checked (``assert_samples_as_generate``):

* first-token distribution: the mean over prompts of the total-variation distance between each sampler's counts
  and the exact distribution (the model's logits through transformers' own temperature / top-k / top-p warpers),
  and between the two samplers' counts. The thresholds are not guessed: ``null_quantile`` draws the same number
  of samples from the exact distribution ``REPLICATES`` times and puts the threshold ``Z_MAX`` standard
  deviations above the mean of the statistic under the hypothesis that both samplers follow it (a parametric
  bootstrap; the statistic is a mean over independent prompts, so close to normal).
* mean reply length and EOS rate: a two-sample z-score against ``generate``'s, its standard error computed from
  the samples' per-prompt variances; ``Z_MAX`` = 4.5 (a false alarm about once in 150,000 runs). So that replies
  both end and run to the budget, a token found in about half of a pilot's replies is a stop token besides EOS
  (``stop_token_ids``, which TRL's configuration takes as one more ``eos_token_id``).

Each engine's test also shows that the check fails a sampler at temperature x1.15 (``wrong_temperature_distance``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gcore.model import ModelConfig, build_tiny_model, char_tokenizer
from gcore.types import SamplingParams

PROMPTS = 16
DRAWS = 256
MAX_NEW_TOKENS = 8
#: the bootstrap's replicates; the threshold is their mean + ``Z_MAX`` standard deviations (the statistic is a mean
#: over independent prompts, close to normal)
REPLICATES = 300
Z_MAX = 4.5
#: the temperature factor that the check must detect
WRONG_TEMPERATURE = 1.15

Replies = list[list[list[int]]]  # [prompt][draw] -> token ids


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


#: sampling values of a checkpoint's generation config (Qwen2.5-Instruct's): TRL overrides each of them with its own
#: (``trl_generation_config``) and gcore's engines ignore them, so they change neither side of the comparison; an
#: engine that applied them (as vLLM's ``LLM.generate`` does for a request without sampling parameters) would fail it
CHECKPOINT_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def peaked_checkpoint(path: str):
    """Write the tiny model with its final norm x6 (next-token distributions of a few likely tokens each), its
    generation config with ``CHECKPOINT_SAMPLING`` and its tokenizer to ``path``; return the tokenizer and ``PROMPTS``
    prompts, all of 7 tokens."""
    tokenizer = char_tokenizer()
    model = build_tiny_model(ModelConfig(num_hidden_layers=2), tokenizer, seed=3)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    model.generation_config.update(**CHECKPOINT_SAMPLING)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rng = torch.Generator().manual_seed(0)
    prompts = [tokenizer.encode(f"{int(torch.randint(10**5, 10**6, (1,), generator=rng))}=", add_special_tokens=False)
               for _ in range(PROMPTS)]
    return tokenizer, prompts


@contextmanager
def warnings_logged(logger: str) -> Iterator[list[str]]:
    """The warnings ``logger`` logs inside the block (a module-scoped fixture has no ``caplog``)."""
    messages: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Recorder(logging.WARNING)
    logging.getLogger(logger).addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger(logger).removeHandler(handler)


def ignored_values_named(messages: list[str]) -> bool:
    """Whether a warning names every value of ``CHECKPOINT_SAMPLING`` but ``do_sample`` (engines sample anyway)."""
    named = [f"{k}={v!r}" for k, v in CHECKPOINT_SAMPLING.items() if k != "do_sample"]
    return any(all(n in m for n in named) for m in messages)


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


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


def first_token_counts(replies: Replies, vocab: int) -> torch.Tensor:
    counts = torch.zeros(len(replies), vocab)
    for i, group in enumerate(replies):
        for reply in group:
            counts[i, reply[0]] += 1
    return counts


def length_stats(replies: Replies, eos: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
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


def generate_replies(model, prompts, config) -> Replies:
    """``generate`` over every prompt at once (all of one length: no padding), ``DRAWS`` replies each; cut after
    the first EOS."""
    torch.manual_seed(2)
    eos = set(config.eos_token_id)
    ids = torch.tensor(prompts).repeat_interleave(DRAWS, dim=0)
    with torch.inference_mode():
        sequences = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    rows = sequences[:, ids.shape[1]:].tolist()
    out: Replies = [[] for _ in prompts]
    for index, row in enumerate(rows):
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        out[index // DRAWS].append(row if stop is None else row[: stop + 1])
    return out


@dataclass
class Reference:
    """``model.generate``'s side of one setting: the engine's ``params`` to compare with it, the exact first-token
    distribution, ``generate``'s replies and the ids that end a reply (EOS and the chosen stop token)."""

    params: SamplingParams
    exact: torch.Tensor
    replies: Replies
    eos: set[int]


def reference(path: str, tokenizer, prompts, *, temperature: float, top_p: float, top_k: int,
              banned: list[int] | None = None) -> Reference:
    """``generate``, configured as TRL configures it, at these settings (``MAX_NEW_TOKENS``, ``DRAWS`` replies per
    prompt), with ``banned`` tokens in ``suppress_tokens`` (an engine that never samples them) and a stop token that
    ends about half of the replies, which ``params`` passes to the engine."""
    model = load_model(path)
    config = trl_generation_config(model, tokenizer, temperature=temperature, top_p=top_p, top_k=top_k,
                                   max_new_tokens=MAX_NEW_TOKENS)
    banned = banned or []
    if banned:
        config.suppress_tokens = banned
    exact = exact_first_token(model, prompts, config, banned)
    stop = stop_token(model, prompts, config, banned)
    config.eos_token_id = [*config.eos_token_id, stop]
    params = SamplingParams(n=DRAWS, max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_token_ids=(stop,))
    return Reference(params, exact, generate_replies(model, prompts, config), set(config.eos_token_id))


def measure(ours: Replies, ref: Reference) -> dict[str, float]:
    """The figures of the check: the engine's replies ``ours`` against the exact first-token distribution and
    ``generate``'s replies, with the thresholds (printed: docs/engines.md quotes them)."""
    vocab = ref.exact.shape[1]
    ours_counts, theirs_counts = first_token_counts(ours, vocab), first_token_counts(ref.replies, vocab)
    ours_length, ours_eos = length_stats(ours, ref.eos)
    theirs_length, theirs_eos = length_stats(ref.replies, ref.eos)
    figures = {
        "tv_engine_exact": mean_tv(ours_counts, ref.exact),
        "tv_generate_exact": mean_tv(theirs_counts, ref.exact),
        "tv_one_sample_threshold": null_quantile(ref.exact, DRAWS, two_sample=False),
        "tv_engine_generate": mean_tv(ours_counts, theirs_counts / DRAWS),
        "tv_two_sample_threshold": null_quantile(ref.exact, DRAWS, two_sample=True),
        "length_engine": float(ours_length.mean()), "length_generate": float(theirs_length.mean()),
        "length_z": z_score(ours_length, theirs_length),
        "eos_engine": float(ours_eos.mean()), "eos_generate": float(theirs_eos.mean()),
        "eos_z": z_score(ours_eos, theirs_eos),
    }
    print({k: round(v, 4) for k, v in figures.items()})
    return figures


def assert_samples_as_generate(ours: Replies, ref: Reference) -> dict[str, float]:
    """The check: the engine's replies ``ours`` sample what ``generate`` samples (``measure``'s figures within
    their thresholds). Returns the figures."""
    figures = measure(ours, ref)
    assert figures["tv_generate_exact"] <= figures["tv_one_sample_threshold"], \
        ("generate does not sample the computed distribution", figures)
    assert figures["tv_engine_exact"] <= figures["tv_one_sample_threshold"], figures
    assert figures["tv_engine_generate"] <= figures["tv_two_sample_threshold"], figures
    assert 0.2 < figures["eos_generate"] < 0.8, "the check of the EOS rate needs replies that end and not"
    assert abs(figures["length_z"]) <= Z_MAX, figures
    assert abs(figures["eos_z"]) <= Z_MAX, figures
    return figures


def exact_at_temperature_one(path: str, tokenizer, prompts) -> torch.Tensor:
    """The exact first-token distribution at TRL's defaults (temperature 1, no top-p or top-k), nothing banned."""
    model = load_model(path)
    config = trl_generation_config(model, tokenizer, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1)
    return exact_first_token(model, prompts, config, [])


def wrong_temperature_params() -> SamplingParams:
    """One token per reply at temperature ``WRONG_TEMPERATURE``: what the check must tell apart from temperature 1."""
    return SamplingParams(n=DRAWS, max_new_tokens=1, temperature=WRONG_TEMPERATURE)


def wrong_temperature_distance(replies: Replies, exact: torch.Tensor) -> tuple[float, float]:
    """The first-token distance of replies sampled at ``WRONG_TEMPERATURE`` to the exact distribution at 1, and the
    check's threshold: the first must exceed the second."""
    return mean_tv(first_token_counts(replies, exact.shape[1]), exact), null_quantile(exact, DRAWS, False)
