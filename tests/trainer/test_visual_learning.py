"""The embedded tiny VLM learns the visual task (``--data.task shape_colour``) from its images, over seeds; the
same runs with blank images (``--data.blank_images``) cannot, and the trained policy falls back to the blind
level when its held-out images are blanked. And image prompts refuse, in one line, what does not take them yet.

A policy that does not see the image can at best answer the most frequent colour everywhere: about 0.27 of the
16 characters right (the train split's answers are 24-28% each). Thresholds from the spread measured on a 2-core
CPU with other work beside it (first-5 -> last-5 mean reward, BENCHMARKS.md):

- real images, seeds 0, 1, 2: every last-5 mean is above ``MIN_LAST``. At 32 steps (2026-11-29, one thread, load
  5-12; benchmarks/results/ci_time.md): 0.540, 0.526, 0.563 (first-5 0.018, 0.015, 0.025); the same runs at 40
  steps 0.791, 0.765, 0.785, and earlier 40-step runs 0.74, 0.77, 0.78 and 0.79, 0.77, 0.79. ``MIN_LAST`` 0.4: 0.13
  below the lowest 32-step seed and 0.13 above the blind policy's best (0.27);
- blank images: the last-5 mean stays below ``BLIND_CEILING`` (measured at 32 steps 0.168 on seed 0; at 40 steps
  0.21 and 0.21 on seed 0, 0.19 on seed 1);
- on the held-out split the trained policy's greedy reward with blank images is below its reward with the real
  ones by more than ``MIN_HELD_OUT_GAP`` (measured 1.0 vs 0.25 after 32 steps, 0.98 vs 0.25 after 40).
``STEPS`` was 40 (266 s of a CI suite, the longest test); 32 keeps each threshold's margin above 0.1. The rewards
rise about linearly over these steps (0.02 -> 0.54 by step 32, 0.79 by 40), and a step's history does not depend
on ``max_steps`` (no schedule over the run), so the 32-step values are the 40-step runs' first 32 steps.
"""

import pytest

from gcore import GRPO, ConfigError, Trainer, TrainerConfig
from gcore.data import DataConfig

SEEDS = (0, 1, 2)
STEPS = 32
MIN_LAST = 0.4
BLIND_CEILING = 0.35
MIN_HELD_OUT_GAP = 0.3
pytestmark = pytest.mark.timeout(2400)


def _fit(tmp_path, seed, blank=False, **trainer):
    return Trainer(
        trainer=TrainerConfig(max_steps=STEPS, seed=seed, default_root_dir=str(tmp_path / f"{seed}{blank}"),
                              enable_progress_bar=False, **trainer),
        data=DataConfig(task="shape_colour", blank_images=blank),
    ).fit()


def _first_last(history):
    rewards = [m["reward/mean"] for m in history]
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5


@pytest.mark.slow
def test_the_tiny_vlm_learns_shape_colour_from_its_images_and_not_from_blank_ones(tmp_path):
    import torch

    from gcore import HFEngine, ModelConfig, SamplingParams
    from gcore.data import load_eval_prompts
    from gcore.evaluation import evaluate
    from gcore.model import ModelSource, load_tokenizer
    from gcore.rewards.rule import TargetCharReward
    from gcore.vision import load_processor

    results = {seed: _fit(tmp_path, seed, save_final=(seed == 0)) for seed in SEEDS}
    blind = _fit(tmp_path, 0, blank=True, save_final=False)
    summary = {seed: f"{first:.3f} -> {last:.3f}" for seed, (first, last) in
               ((seed, _first_last(r.history)) for seed, r in results.items())}
    blind_first, blind_last = _first_last(blind.history)
    print("real images, first-5 -> last-5 per seed:", summary, f"blank images (seed 0): {blind_first:.3f} -> "
          f"{blind_last:.3f}")  # shown with pytest -s
    assert all(_first_last(r.history)[1] > MIN_LAST for r in results.values()), summary
    assert blind_last < BLIND_CEILING, blind_last

    # the trained policy on the held-out split: with its images, and with the same prompts' images blanked
    final = results[0].final_model_dir
    assert final is not None
    engine = HFEngine()
    engine.setup(ModelSource(final), torch.device("cpu"))
    processor, tokenizer = load_processor(final, False), load_tokenizer(ModelConfig(), vision=True)
    params = SamplingParams(n=1, max_new_tokens=16, stop_token_ids=(tokenizer.eos_token_id,))
    scores = {}
    for blank in (False, True):
        prompts = load_eval_prompts(DataConfig(task="shape_colour", blank_images=blank, num_eval_prompts=64),
                                    tokenizer, 16, None, processor)
        scores[blank] = evaluate(engine, TargetCharReward(16), tokenizer, prompts, params)["eval/accuracy_greedy"]
    print("held-out greedy reward, real vs blank images:", scores)
    assert scores[False] - scores[True] > MIN_HELD_OUT_GAP, scores


@pytest.mark.parametrize("options, message", [
    ({"engine": "sglang"}, r"--data.task shape_colour: image prompts need --engine hf"),
    ({"placement": "tokens_only"}, r"--placement _TokensOnly does not hand its engines the prompts' images"),
    ({"backend": {"sequence_parallel_size": 2}}, r"--backend.sequence_parallel_size 2 does not take image prompts"),
    ({"backend": {"packing": True}}, r"--backend.packing true does not take image prompts"),
    ({"backend": {"compile": True}}, r"--backend.compile true does not take image prompts"),
    ({"env": "reveal"}, r"multi-turn episodes \(--env RevealEnvironment\) do not carry images"),
    ({"megatron": True}, r"--backend MegatronBackend does not train on image prompts"),
])
def test_what_does_not_take_image_prompts_yet_refuses_in_one_line(options, message):
    from gcore import StaticPlacement, TorchBackend

    kwargs: dict = {"data": DataConfig(task="shape_colour"), "algorithm": GRPO()}
    if options.get("engine") == "sglang":
        from gcore.engines.sglang import SGLangEngine

        kwargs["engine"] = SGLangEngine.__new__(SGLangEngine)  # never set up: the check reads its class
    if options.get("placement") == "tokens_only":
        class _TokensOnly(StaticPlacement):
            supports_images = False  # a policy that hands its engines token ids only

        kwargs["placement"] = _TokensOnly()
    if "backend" in options:
        kwargs["backend"] = TorchBackend(**options["backend"])
        if options["backend"].get("sequence_parallel_size"):
            kwargs["trainer"] = TrainerConfig(devices=2)
    if options.get("env") == "reveal":
        from gcore.envs.reveal import RevealEnvironment

        kwargs["env"] = RevealEnvironment()
    if options.get("megatron"):
        pytest.importorskip("megatron.core")
        from gcore.backends.megatron import MegatronBackend

        kwargs["backend"] = MegatronBackend()
    with pytest.raises(ConfigError, match=message) as error:
        Trainer(**kwargs)
    assert "\n" not in str(error.value)


def test_image_prompts_with_a_text_only_checkpoint_refuse_in_one_line(tmp_path):
    from gcore import ModelConfig
    from gcore.model import char_tokenizer, materialize

    config = ModelConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64)
    path = materialize(config, char_tokenizer(), 0, str(tmp_path / "text"))
    trainer = Trainer(trainer=TrainerConfig(max_steps=1, default_root_dir=str(tmp_path / "runs"),
                                            enable_progress_bar=False),
                      model=ModelConfig(path=path), data=DataConfig(task="shape_colour"))
    with pytest.raises(ConfigError, match="image prompts need an image-text-to-text checkpoint"):
        trainer.fit()
