"""The ``hf`` engine on image prompts (the embedded tiny Qwen2-VL-shaped model): the log-probabilities it samples
with are the trainer's, recomputed over prompt and response with the same visual inputs and M-RoPE positions."""

import pytest
import torch
from conftest import COLOURS, image_prompts, image_samples
from lightning_fabric import Fabric
from PIL import Image

from gcore import GRPO, PPO, HFEngine, ModelConfig, SamplingParams, TorchBackend
from gcore.model import load_tokenizer, materialize
from gcore.types import Prompt, collate
from gcore.vision import encode, load_processor


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    config = ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    tokenizer = load_tokenizer(config, vision=True)
    path = materialize(config, tokenizer, seed=0, workdir=str(tmp_path_factory.mktemp("vlm")), vision=True)
    engine = HFEngine()
    engine.setup(config.source(path), torch.device("cpu"))
    return config, tokenizer, path, engine, load_processor(path, trust_remote_code=False)


def test_engine_logprobs_match_the_trainers_on_image_prompts(vlm):
    config, tokenizer, path, engine, processor = vlm
    prompts = image_prompts(processor)
    assert len({len(p.token_ids) for p in prompts}) == 3  # left padding in the engine, right padding in the trainer
    assert prompts[0].token_ids == prompts[3].token_ids  # the same tokens, other images: not one prefill
    backend = TorchBackend(micro_batch_size=3)
    backend.setup(Fabric(accelerator="cpu", devices=1), config.source(path), GRPO(kl_coef=0.0), embedded=True)
    params = SamplingParams(n=3, max_new_tokens=12, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,))
    torch.manual_seed(0)
    batch = collate(image_samples(engine, tokenizer, prompts, params), tokenizer.pad_token_id, params.temperature)
    recomputed = backend.compute_logprobs(batch, "policy")
    gap = float(((recomputed - batch.engine_logprobs) * batch.response_mask).abs().max())
    assert gap < 1e-4, gap
    # the images matter: prompts 0 and 3 (rows 0-2 and 9-11) have the same tokens; with each other's images
    # the same responses get other log-probabilities
    assert batch.visual is not None
    batch.visual = batch.visual[9:] + batch.visual[3:9] + batch.visual[:3]
    moved = ((backend.compute_logprobs(batch, "policy") - batch.engine_logprobs) * batch.response_mask).abs()
    assert float(moved[:3].max()) > 1e-3 and float(moved[3:9].max()) < 1e-4


def test_a_response_never_holds_an_image_placeholder(vlm):
    config, tokenizer, path, engine, processor = vlm
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert image_token in engine.media_ids
    torch.manual_seed(0)
    samples = image_samples(engine, tokenizer, image_prompts(processor), SamplingParams(n=8, max_new_tokens=24))
    assert all(image_token not in s.response_ids for s in samples)


def test_ppo_trains_policy_and_critic_on_image_prompts_with_a_frozen_vision_encoder(vlm):
    from gcore.testing import set_up
    from gcore.vision import vision_parameters

    config, tokenizer, path, engine, processor = vlm
    backend = TorchBackend(freeze_vision=True, micro_batch_size=4)
    algorithm = set_up(PPO(), 12)
    backend.setup(Fabric(accelerator="cpu", devices=1), config.source(path), algorithm, embedded=True)
    frozen = {id(p) for p in vision_parameters(backend.hf_model)}
    assert frozen and all(not p.requires_grad for p in vision_parameters(backend.critic.module.trunk))
    before = {name: p.detach().clone() for name, p in backend.hf_model.named_parameters()}
    torch.manual_seed(0)
    params = SamplingParams(n=2, max_new_tokens=12)
    batch = collate(image_samples(engine, tokenizer, image_prompts(processor), params), tokenizer.pad_token_id, 1.0)
    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 2
    batch.values = backend.compute_values(batch)
    batch.old_logprobs = backend.compute_logprobs(batch, "policy")
    batch.advantages = algorithm.advantages(batch)
    metrics = backend.train(batch, algorithm)
    assert all(map(lambda v: v == v, metrics.values()))  # finite (no NaN)
    changed = {name for name, p in backend.hf_model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and not any(".visual." in f".{name}" for name in changed)
    assert any("language_model" in name for name in changed)
    # the sync sends only what training can change; an engine that took it holds the trainer's weights, all of them
    sent = dict(backend.named_weights())
    assert sent and not any(".visual." in f".{name}" for name in sent)
    assert set(sent) | {n for n, p in backend.hf_model.named_parameters() if not p.requires_grad} == \
        set(backend.hf_model.state_dict())
    fresh = HFEngine()
    fresh.setup(config.source(path), torch.device("cpu"))
    fresh.update_weights(sent.items())
    trained = backend.hf_model.state_dict()
    assert fresh.model is not None
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


@pytest.mark.parametrize("checkpoint", ["embedded", "llava"])
def test_the_critic_starts_from_the_checkpoints_weights_vision_encoder_included(vlm, checkpoint, tmp_path):
    """Every weight of the critic's trunk is the policy's (transformers 5's ``AutoModel`` loaded the embedded
    checkpoint's vision encoder under other names and left it random, so the critic saw noise in place of the
    images)."""
    from gcore.model import ModelSource

    config, _, path, _, _ = vlm
    source = config.source(path) if checkpoint == "embedded" else ModelSource(_tiny_llava(str(tmp_path / "llava")))
    backend = TorchBackend()
    backend.setup(Fabric(accelerator="cpu", devices=1), source, PPO(), embedded=checkpoint == "embedded")
    policy = dict(backend.hf_model.base_model.named_parameters())
    trunk = dict(backend.critic.module.trunk.named_parameters())
    assert trunk.keys() == policy.keys() and any(name.startswith(("visual.", "vision_tower.")) for name in trunk)
    for name, tensor in trunk.items():
        assert torch.equal(tensor, policy[name]), name


def test_lora_adapts_the_language_part_and_the_engine_follows_the_sync(vlm):
    """LoRA on an image-text-to-text model: adapters on the language part's linear layers only, the vision encoder
    frozen; after a training step and a weight sync, the engine's log-probabilities are again the trainer's."""
    pytest.importorskip("peft")
    from gcore.algorithms.base import group_normalize
    from gcore.testing import set_up

    config, tokenizer, path, _, processor = vlm
    engine = HFEngine()
    engine.setup(config.source(path), torch.device("cpu"))
    backend = TorchBackend(lora_rank=4, micro_batch_size=4)
    algorithm = set_up(GRPO(kl_coef=0.0), 12)
    backend.setup(Fabric(accelerator="cpu", devices=1), config.source(path), algorithm, embedded=True)
    adapted = [name for name, p in backend.hf_model.named_parameters() if p.requires_grad]
    assert adapted and all(".lora_" in name and "language_model" in name for name in adapted)
    params = SamplingParams(n=2, max_new_tokens=12, stop_token_ids=(tokenizer.eos_token_id,))
    torch.manual_seed(0)
    batch = collate(image_samples(engine, tokenizer, image_prompts(processor), params), tokenizer.pad_token_id, 1.0)
    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 2
    batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
    backend.train(batch, algorithm)
    stale = ((backend.compute_logprobs(batch, "policy") - batch.engine_logprobs) * batch.response_mask).abs().max()
    assert float(stale) > 1e-4  # the step moved the policy
    engine.update_weights(backend.named_weights())
    torch.manual_seed(1)
    batch = collate(image_samples(engine, tokenizer, image_prompts(processor), params), tokenizer.pad_token_id, 1.0)
    gap = ((backend.compute_logprobs(batch, "policy") - batch.engine_logprobs) * batch.response_mask).abs().max()
    assert float(gap) < 1e-4


def _tiny_llava(folder: str) -> str:
    """A tiny Llava-style checkpoint (CLIP vision tower, Qwen2 language model, 1D positions) with a
    ``LlavaProcessor`` that ``AutoProcessor`` loads: the path of a checkpoint that is not Qwen2-VL-shaped."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from gcore.model import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
                               "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 28},
                                                                  crop_size={"height": 28, "width": 28}),
                               tokenizer=tokenizer, chat_template=tokenizer.chat_template, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_a_llava_style_checkpoint_with_1d_positions_samples_the_trainers_logprobs(tmp_path):
    """Not only Qwen2-VL: a checkpoint with plain 1D positions and transformers' own processor (AutoProcessor)."""
    from transformers import LlavaProcessor

    from gcore.model import ModelSource, image_text_to_text
    from gcore.vision import rope_model

    path = _tiny_llava(str(tmp_path / "llava"))
    assert image_text_to_text(path)
    processor = load_processor(path, trust_remote_code=False)
    assert isinstance(processor, LlavaProcessor)
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    assert rope_model(engine.model) is None
    prompts = []
    for i, text in enumerate(["c=", "what colour=", "c="]):
        token_ids, visual = encode(processor, text, [Image.new("RGB", (40, 40), COLOURS[i])], f"row {i}")
        prompts.append(Prompt(i, text, token_ids, "r", f"row {i}", {}, None, visual))
    backend = TorchBackend(micro_batch_size=4)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=False)
    tokenizer = processor.tokenizer
    params = SamplingParams(n=3, max_new_tokens=10, stop_token_ids=(tokenizer.eos_token_id,))
    torch.manual_seed(0)
    batch = collate(image_samples(engine, tokenizer, prompts, params), tokenizer.pad_token_id, 1.0)
    gap = ((backend.compute_logprobs(batch, "policy") - batch.engine_logprobs) * batch.response_mask).abs().max()
    assert float(gap) < 1e-4


def test_a_qwen2_5_vl_checkpoint_samples_the_trainers_logprobs(tmp_path, vlm):
    """Qwen2.5-VL (windowed vision attention, its own M-RoPE): the same parity through the same code."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from gcore.model import VISION_TOKENS, ModelSource, vl_image_processor

    _, tokenizer, _, _, _ = vlm
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]}, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1]),
        tie_word_embeddings=True, **{n: tokenizer.convert_tokens_to_ids(t) for n, t in zip(names, VISION_TOKENS,
                                                                                          strict=True)})
    torch.manual_seed(0)
    path = str(tmp_path / "qwen2_5_vl")
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    vl_image_processor().save_pretrained(path)
    processor = load_processor(path, trust_remote_code=False)
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    backend = TorchBackend(micro_batch_size=4)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=False)
    params = SamplingParams(n=3, max_new_tokens=10, stop_token_ids=(tokenizer.eos_token_id,))
    torch.manual_seed(0)
    batch = collate(image_samples(engine, tokenizer, image_prompts(processor), params), tokenizer.pad_token_id, 1.0)
    gap = ((backend.compute_logprobs(batch, "policy") - batch.engine_logprobs) * batch.response_mask).abs().max()
    assert float(gap) < 1e-4
