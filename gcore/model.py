"""The policy model and tokenizer: a local HF checkpoint, or the embedded tiny default."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from gcore.errors import ConfigError, GcoreError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

CHAR_TOKENIZER = Path(__file__).parent / "assets" / "char_tokenizer.json"
#: files of which an HF tokenizer is built: a folder with none of them has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``--model.architecture``: the embedded model's transformers architecture
ARCHITECTURES = ("qwen2", "qwen3_moe")


@dataclass(frozen=True)
class ModelSource:
    """Where a model is loaded from: what an ``Engine``, a ``TrainingBackend`` and a placement policy's
    ``launch`` are given (``ModelConfig.source`` makes the policy's once its checkpoint is on disk).

    Args:
        path: an HF checkpoint directory.
        dtype: the parameter dtype to load it in.
        trust_remote_code: allow the checkpoint's own Python code to run.
    """

    path: str
    dtype: torch.dtype = torch.float32
    trust_remote_code: bool = False

    def context_length(self) -> int | None:
        """The model's maximum sequence length, read from its config."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        return getattr(config.get_text_config(), "max_position_embeddings", None)


@dataclass
class ModelConfig:
    """The policy model.

    Args:
        path: a local HF checkpoint directory (model and tokenizer), or a ``.gguf`` file (dequantised
            and converted to an HF checkpoint when the run starts; ``gcore import`` does it once). Unset:
            build the embedded tiny model (``architecture``) from the fields below, with the shipped character
            tokenizer.
        trust_remote_code: allow the checkpoint's own Python code to run.
        dtype: parameter dtype of the trainer's and engine's copies.
        hidden_size: embedded model only.
        num_hidden_layers: embedded model only.
        num_attention_heads: embedded model only.
        num_key_value_heads: embedded model only.
        intermediate_size: embedded model only.
        max_position_embeddings: embedded model only: its context length.
        architecture: embedded model only: ``qwen2`` (dense, the default) or ``qwen3_moe`` (a mixture of experts,
            transformers' Qwen3-MoE: every layer's MLP is ``num_experts`` experts of ``moe_intermediate_size``, each
            token routed to ``num_experts_per_tok`` of them; docs/moe.md).
        num_experts: embedded ``qwen3_moe`` model only: experts per layer.
        num_experts_per_tok: embedded ``qwen3_moe`` model only: experts each token is routed to (top-k).
        moe_intermediate_size: embedded ``qwen3_moe`` model only: each expert's MLP width.
    """

    path: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    architecture: Literal["qwen2", "qwen3_moe"] = "qwen2"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"--model.architecture {self.architecture!r}: valid choices: {', '.join(ARCHITECTURES)}")
        if self.architecture == "qwen3_moe":
            if self.num_experts < 1:
                raise ConfigError(f"--model.num_experts {self.num_experts} must be >= 1")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"--model.num_experts_per_tok {self.num_experts_per_tok} must be in "
                                  f"[1, --model.num_experts {self.num_experts}]")
            if self.moe_intermediate_size < 1:
                raise ConfigError(f"--model.moe_intermediate_size {self.moe_intermediate_size} must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def embedded(self) -> bool:
        return self.path is None

    def source(self, path: str) -> ModelSource:
        """The policy's ``ModelSource``: ``path`` is the checkpoint directory ``materialize`` returned
        (the embedded model's or a converted GGUF file's folder, else ``self.path``)."""
        return ModelSource(path, self.torch_dtype, self.trust_remote_code)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """The embedded character-level tokenizer (a ``PreTrainedTokenizerFast``)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(CHAR_TOKENIZER),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.padding_side = "left"
    return tokenizer


#: the embedded tiny VLM's chat template: its images' placeholders, then the text (no roles: the task's prompts are
#: a few characters, and the tiny model learns from scratch)
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)
#: the vision tokens of the embedded tiny VLM (Qwen2-VL's), added to the character tokenizer
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
#: the embedded tiny VLM's images: resized to this many pixels (56 x 56: 4 x 4 patches of 14, 4 image tokens)
VL_IMAGE_PIXELS = 56 * 56


def vl_tokenizer() -> PreTrainedTokenizerFast:
    """The embedded tiny VLM's tokenizer: the character tokenizer with Qwen2-VL's vision tokens and a chat
    template that places the images before the text."""
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def vl_image_processor():  # noqa: ANN201  transformers' Qwen2-VL image processor (its PIL one without torchvision)
    """The embedded tiny VLM's image processor: Qwen2-VL's (its PIL implementation, which needs no torchvision),
    every image resized to ``VL_IMAGE_PIXELS``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=VL_IMAGE_PIXELS, max_pixels=VL_IMAGE_PIXELS, patch_size=14,
                                    merge_size=2, temporal_patch_size=2)


def build_tiny_vlm(config: ModelConfig, tokenizer, seed: int):  # noqa: ANN001, ANN201  a Qwen2VLForConditionalGeneration
    """A randomly initialised Qwen2-VL-shaped model: the embedded model's language part (``config``'s sizes) and a
    2-block, 64-wide vision encoder on 14-pixel patches; the same weights for the same seed."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    head_dim = config.hidden_size // config.num_attention_heads
    quarter = head_dim // 8  # M-RoPE splits each head's rotary half into temporal, height and width sections
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"), VISION_TOKENS,
               strict=True)}
    hf_config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
            intermediate_size=config.intermediate_size, max_position_embeddings=config.max_position_embeddings,
            rope_scaling={"type": "mrope", "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter]},
            tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=config.hidden_size, num_heads=4, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        tie_word_embeddings=True, **ids,
    )
    model = _seeded(Qwen2VLForConditionalGeneration, hf_config, tokenizer, seed)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.to(config.torch_dtype)


def image_text_to_text(path: str, trust_remote_code: bool = False) -> bool:
    """Whether the checkpoint at ``path`` is an image-text-to-text model (``AutoModelForImageTextToText`` loads
    it), read from its ``config.json``."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def causal_lm_class(source: ModelSource):  # noqa: ANN201  a transformers auto class
    """The auto class that loads ``source`` with its LM head: ``AutoModelForImageTextToText`` for an
    image-text-to-text checkpoint, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if image_text_to_text(source.path, source.trust_remote_code):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def build_tiny_model(config: ModelConfig, tokenizer, seed: int) -> PreTrainedModel:  # noqa: ANN001
    """A randomly initialised causal LM of ``config.architecture`` (Qwen2-style, or Qwen3-MoE); the same weights for
    the same seed."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if config.architecture == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        # the router's load-balancing loss is the backend's option (--backend.router_aux_loss_coef), not the model's
        moe_config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a keyword the stubs do not list
            **common, head_dim=config.hidden_size // config.num_attention_heads, num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
            decoder_sparse_step=1, norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.0)
        return _seeded(Qwen3MoeForCausalLM, moe_config, tokenizer, seed).to(config.torch_dtype)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = _seeded(Qwen2ForCausalLM, Qwen2Config(**common), tokenizer, seed)
    return model.to(config.torch_dtype)


def _seeded(model_class, hf_config, tokenizer, seed: int):  # noqa: ANN001, ANN202  transformers classes
    """``model_class(hf_config)`` initialised from ``seed`` (the caller's random state left as it was), its
    generation config given the tokenizer's pad and end tokens."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_class(hf_config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def load_tokenizer(config: ModelConfig, vision: bool = False):  # noqa: ANN201
    """The tokenizer of ``config.path`` (or the embedded one: with ``vision``, the tiny VLM's), with a pad token
    and left padding."""
    if config.embedded:
        return vl_tokenizer() if vision else char_tokenizer()
    from transformers import AutoTokenizer

    assert config.path is not None  # not embedded: a path was given
    _check_path(config.path)
    if not is_gguf(config.path) and not any(os.path.isfile(os.path.join(config.path, name))
                                            for name in TOKENIZER_FILES):
        raise ConfigError(f"--model.path {config.path}: no tokenizer files in the folder (none of "
                          f"{', '.join(TOKENIZER_FILES)}); copy the model's tokenizer files next to its weights")
    try:
        if is_gguf(config.path):
            tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(config.path)),
                                                      gguf_file=os.path.basename(config.path), trust_remote_code=False)
        else:
            tokenizer = AutoTokenizer.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
    except Exception as err:
        raise ConfigError(f"--model.path {config.path}: cannot load a tokenizer: {type(err).__name__}: {err}") from err
    if len(tokenizer) < 2:  # transformers builds an empty tokenizer from a config that names its class only
        raise ConfigError(f"--model.path {config.path}: the tokenizer has a vocabulary of {len(tokenizer)}: its "
                          "tokenizer files are missing or empty")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def is_gguf(path: str) -> bool:
    """Whether ``path`` names a GGUF file (llama.cpp's single-file format)."""
    return path.lower().endswith(".gguf")


def _check_path(path: str, flag: str = "--model.path") -> None:
    if is_gguf(path):
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path!r}: no such GGUF file")
        return
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is not a directory (expected a local HF checkpoint or a .gguf file)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{flag} {path!r} has no config.json: not an HF checkpoint directory")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_weights(path: str) -> None:
    """A one-line ``ConfigError`` for a model folder without weights or with a damaged safetensors file.

    Every ``*.safetensors`` file's header is read (cheap: no tensor data), which also finds a file
    cut short: its header then describes more bytes than the file has.
    """
    from safetensors import safe_open

    names = sorted(os.listdir(path))
    if not any(name in WEIGHT_FILES or name.endswith(".safetensors") for name in names):
        raise ConfigError(f"--model.path {path}: no weights ({' or '.join(WEIGHT_FILES[::2])}) in the folder")
    for name in names:
        if name.endswith(".safetensors"):
            file = os.path.join(path, name)
            try:
                with safe_open(file, "pt"):
                    pass
            except Exception as err:  # noqa: BLE001  safetensors raises its own error types
                detail = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise ConfigError(f"{file}: corrupt or truncated safetensors file ({detail})") from None


def check_custom_code(path: str, trust_remote_code: bool) -> None:
    """A one-line ``ConfigError`` for a model folder that only its own code could load: its ``config.json``
    names custom code (``auto_map``) for a ``model_type`` transformers does not know, and
    ``--model.trust_remote_code`` is off. (With a ``model_type`` transformers knows, its own classes load
    the folder and no code from it runs.)"""
    import json

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # no config or not JSON: reported where the config is loaded
    if not isinstance(config, dict) or trust_remote_code or not config.get("auto_map"):
        return
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        auto_map = config["auto_map"]
        classes = ", ".join(map(str, auto_map.values() if isinstance(auto_map, dict) else auto_map))
        raise ConfigError(f"--model.path {path}: config.json names custom code ({classes}) for a model_type "
                          f"transformers does not know ({model_type!r}); pass --model.trust_remote_code true only "
                          "if you trust this folder's code")


def check_pickled_weights(path: str) -> None:
    """A one-line ``ConfigError`` for a ``pytorch_model*.bin`` weights file that holds Python objects other
    than tensors (a pickle could run code; transformers loads it with ``weights_only`` and fails with a
    traceback). Only where transformers loads them: a folder with safetensors weights is loaded from those,
    and other ``.bin`` files (``training_args.bin``) are not weights. A file in torch's zip format is read
    mapped (the pickle, not the tensor data); an older one whole."""
    import pickle
    import warnings
    import zipfile

    names = sorted(os.listdir(path))
    if any(name.endswith(".safetensors") for name in names):
        return
    for name in names:
        if not (name.startswith("pytorch_model") and name.endswith(".bin")):
            continue
        file = os.path.join(path, name)
        try:
            with warnings.catch_warnings():  # torch's note on the pickle protocol of a file it then refuses
                warnings.simplefilter("ignore")
                torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
        except pickle.UnpicklingError:
            raise ConfigError(f"{file}: refused: it holds Python objects other than tensors, which could run code "
                              "on load; convert the weights to safetensors from a trusted copy") from None


WORKDIR_PREFIX = "gcore-model-"


def make_workdir() -> str:
    """A temp folder for the embedded model's files, named after this process (``gcore-model-<pid>-*``),
    after removing those of gcore processes that are gone (killed before they could clean up)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        match = re.match(rf"{WORKDIR_PREFIX}(\d+)-", name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def materialize(config: ModelConfig, tokenizer, seed: int, workdir: str, vision: bool = False) -> str:  # noqa: ANN001
    """The HF checkpoint directory that trainer and engine load from.

    For the embedded model, builds it with ``seed`` and writes it (with its tokenizer) under
    ``workdir``, so that every engine loads weights the same way: from a directory; with ``vision``
    (image prompts) the tiny VLM (``build_tiny_vlm``), with its image processor. A GGUF file
    is converted into ``workdir`` (``import_gguf``).
    """
    if not config.embedded:
        assert config.path is not None  # not embedded: a path was given
        _check_path(config.path)
        if is_gguf(config.path):
            print(f"converting {config.path} to an HF checkpoint for this run "
                  "(`gcore import` converts it once for later runs)", flush=True)
            return import_gguf(config.path, workdir, config.torch_dtype)
        check_weights(config.path)
        check_pickled_weights(config.path)
        check_custom_code(config.path, config.trust_remote_code)
        return config.path
    from safetensors.torch import save_file

    if vision and config.architecture != "qwen2":
        raise ConfigError(f"--model.architecture {config.architecture}: the embedded model with image prompts is the "
                          "tiny Qwen2-VL (dense); use --model.architecture qwen2, or a local MoE VLM checkpoint")
    model = build_tiny_vlm(config, tokenizer, seed) if vision else build_tiny_model(config, tokenizer, seed)
    os.makedirs(workdir, exist_ok=True)
    # not model.save_pretrained: under torch.distributed it writes on global rank 0 only, and every
    # rank needs its own copy here (no shared file system). Tied weights are stored under the
    # embedding's name, as save_pretrained does: vLLM's loader skips lm_head.weight when tied.
    if config.architecture != "qwen2" and not vision:
        # save_pretrained would name the class: vLLM picks its model from ``architectures`` and, without them, loads
        # a Qwen3-MoE config as an embedding model (Qwen3MoeModel)
        model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(workdir)
    model.generation_config.save_pretrained(workdir)
    state = model.state_dict()
    if model.config.get_text_config().tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(workdir, "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(workdir)
    if vision:
        vl_image_processor().save_pretrained(workdir)
    if not os.path.isfile(os.path.join(workdir, "config.json")):
        raise GcoreError(f"could not write the embedded model to {workdir}")
    return workdir


def _gguf_architecture(gguf_path: str) -> str | None:
    """The ``general.architecture`` of a GGUF file (its header, memory-mapped), or ``None`` where it cannot be read."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf_path).fields.get("general.architecture")
        return bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except (OSError, ValueError, KeyError, IndexError, UnicodeDecodeError):  # transformers then fails, saying why
        return None


def import_gguf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Convert a GGUF file into an HF checkpoint directory (model, tokenizer, chat template).

    transformers dequantises the GGUF tensors (Q4/Q8/...) to ``dtype``; the model it returns is marked
    quantised and refuses ``save_pretrained``, so its weights are loaded into a plain model built from
    the same config and that one is saved. Needs the ``gguf`` package. Returns ``out_dir``.
    """
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConfigError(f"{gguf_path}: reading GGUF files needs the gguf package: pip install gguf") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_path(gguf_path)
    if dtype == torch.float16 and _gguf_architecture(gguf_path) == "gemma3":  # before the (long) dequantisation
        raise ConfigError(f"{gguf_path}: --dtype float16: a Gemma 3 model's activations overflow float16; choose "
                          "bfloat16 or float32")
    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    try:
        # a GGUF file holds weights and metadata only: no code of its own to trust
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, trust_remote_code=False)
    except Exception as err:
        raise ConfigError(f"{gguf_path}: cannot load as a GGUF model: {type(err).__name__}: {err}") from err
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    with_turn_template(config, tokenizer, model.generation_config, gguf_path)
    os.makedirs(out_dir, exist_ok=True)
    # not model.save_pretrained under torch.distributed: see ``materialize``; this runs before launch
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


#: Gemma 3's chat template (the one google/gemma-3-* tokenizers ship), for a Gemma 3 GGUF file that holds none (the
#: 270M pretrained model's): a system message goes before the first user turn, the assistant's role is ``model``
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def with_turn_template(config, tokenizer, generation, source: str) -> None:  # noqa: ANN001
    """Gemma 3 (``model_type`` ``gemma3_text``/``gemma3``): the turn-end token ``<end_of_turn>`` ends a generation
    besides ``<eos>`` (``generation.eos_token_id`` becomes both, as Google's checkpoints have it: the ``hf`` engine,
    vLLM and SGLang stop there), and a tokenizer without a chat template gets Gemma 3's (``GEMMA3_CHAT_TEMPLATE``).
    Other models are left as they are. A Gemma 3 vocabulary without ``<end_of_turn>`` is refused (``source`` named)."""
    if getattr(config, "model_type", None) not in ("gemma3_text", "gemma3"):
        return
    turn_end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if not isinstance(turn_end, int) or turn_end == tokenizer.unk_token_id:
        raise ConfigError(f"{source}: a Gemma 3 model whose vocabulary has no <end_of_turn> token: its chat turns "
                          "could not end")
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    eos = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
    generation.eos_token_id = [*eos, turn_end] if turn_end not in eos else eos


def family_checks(source: ModelSource, engine_dtype: str | None = None) -> tuple[int, ...]:
    """What a model family needs at the start of a run; returns the extra token ids that end a generation.

    Gemma 3 (``gemma3_text``/``gemma3``): ``<end_of_turn>`` ends a chat reply besides ``<eos>`` (returned, so that
    every engine stops there, not only those that read the checkpoint's generation config), and float16 is refused:
    Gemma's activations exceed float16's range (use bfloat16 or float32). Other models: nothing, ``()``.
    """
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(source.path, trust_remote_code=source.trust_remote_code)
    if getattr(config, "model_type", None) not in ("gemma3_text", "gemma3"):
        return ()
    for flag, dtype in (("--model.dtype", source.dtype), ("--engine.dtype", engine_dtype)):
        if dtype in (torch.float16, "float16"):
            raise ConfigError(f"{flag} float16: {source.path} is a Gemma 3 model, whose activations overflow "
                              "float16; choose bfloat16 or float32")
    tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=source.trust_remote_code)
    turn_end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    return (turn_end,) if isinstance(turn_end, int) and turn_end != tokenizer.unk_token_id else ()


#: the file a finished ``converted_gguf`` folder holds: what it was converted from
CONVERTED_FROM = "gcore-converted-from.json"


def converted_gguf(gguf_path: str, folder: str, dtype: torch.dtype = torch.float32, flag: str = "--model.path",
                   announce: str = "") -> str:
    """The HF checkpoint folder of ``gguf_path`` under ``folder``, converted (``import_gguf``) only where no
    finished conversion of the same file (its absolute path, size and modification time) is there yet.

    For a file several processes of one run load (the generative judge's: every controller and engine worker):
    the first converts it, the others find it. A conversion is written to a folder of its own and renamed into
    place when complete, so a process never loads a half-written one; two processes converting at once both
    finish and one of the two folders is kept. Leftovers of converting processes that are gone are removed.
    ``announce`` is printed when this process converts.
    """
    import json

    _check_path(gguf_path, flag)
    stat = os.stat(gguf_path)
    origin = {"gguf": os.path.abspath(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "dtype": str(dtype).removeprefix("torch.")}
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(gguf_path)[: -len(".gguf")])
    target = os.path.join(folder, f"{stem}-{origin['dtype']}")
    marker = os.path.join(target, CONVERTED_FROM)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            if json.load(f) == origin:
                return target
        shutil.rmtree(target, ignore_errors=True)  # another file of that name (or a changed one): converted again
    os.makedirs(folder, exist_ok=True)
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())  # a shared folder may see other machines' processes
    for name in os.listdir(folder):  # a conversion whose process (on this machine) was killed
        match = re.match(rf"\.converting-{host}-(\d+)-", name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    if announce:
        print(announce, flush=True)
    work = tempfile.mkdtemp(prefix=f".converting-{host}-{os.getpid()}-", dir=folder)
    try:
        import_gguf(gguf_path, work, dtype)
        with open(os.path.join(work, CONVERTED_FROM), "w", encoding="utf-8") as f:
            json.dump(origin, f)
        try:
            os.rename(work, target)
        except OSError:  # another process put its conversion there first: use that one
            if not os.path.isfile(marker):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def import_main(argv) -> int:  # noqa: ANN001
    """``gcore import FILE.gguf OUT_DIR [--dtype float32]``: a GGUF file as an HF checkpoint directory."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="gcore import", description="Convert a GGUF model file (dequantised) to an HF checkpoint directory "
        "that --model.path, from_pretrained, vLLM and SGLang load.")
    parser.add_argument("gguf_file", help="a .gguf file")
    parser.add_argument("out_dir", help="the HF checkpoint directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (default float32)")
    args = parser.parse_args(list(argv))
    if not is_gguf(args.gguf_file):
        raise ConfigError(f"gcore import {args.gguf_file}: expected a .gguf file")
    if os.path.exists(os.path.join(args.out_dir, "config.json")):
        raise ConfigError(f"gcore import: {args.out_dir} already holds a checkpoint; choose another folder")
    import_gguf(args.gguf_file, args.out_dir, DTYPES[args.dtype])
    print(f"HF checkpoint: {args.out_dir}")
    return 0


def check_compiler(flag: str, device: torch.device) -> None:
    """Refuse ``flag`` (a ``torch.compile`` option) on a CPU without a C++ compiler: TorchInductor builds its CPU
    kernels with one (``g++``, ``c++`` or ``clang++`` on the path, or the one ``CXX`` names)."""
    if device.type != "cpu":
        return
    if not any(c and shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++")):
        raise ConfigError(f"{flag} true needs a C++ compiler on CPU (TorchInductor builds its kernels with g++ or "
                          f"clang++; set CXX to one): install one, or use {flag} false")


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a transformers model takes its KV cache by: ``cache`` where it has one (newer
    releases deprecate ``past_key_values``, with a warning on every call), else ``past_key_values``."""
    import inspect

    for _ in range(8):  # a wrapper (Fabric's, DDP's, torch.compile's) forwards any keyword: ask the model inside
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
