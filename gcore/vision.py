"""Image prompts (docs/multimodal.md): reading an image (PIL), a processor that turns text and images into a
prompt's token ids and visual inputs, and what an image-text-to-text model takes besides the token ids (its
visual inputs and, for Qwen2-VL-style models, their 3D "M-RoPE" positions), the same in the engine and in
the trainer."""

from __future__ import annotations

import base64
import binascii
import inspect
import io
import os
import threading
from typing import TYPE_CHECKING, Any

import torch

from gcore.errors import ConfigError, DataError
from gcore.types import VisualInputs

if TYPE_CHECKING:
    from PIL.Image import Image

#: the modules that hold an image-text-to-text model's vision encoder and projector (transformers' names)
VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "connector")
#: the model types whose processor ``ImageTokenProcessor`` stands in for where transformers' cannot be built
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")


#: ``--data.resize_max_pixels``: the most pixels gcore decodes to scale an image down (Pillow's own bomb limit)
DEFAULT_RESIZE_MAX_PIXELS = 89_478_485
_PILLOW_LIMIT = threading.Lock()  # Pillow's bomb check is a module global, set aside while gcore opens a file


def read_image(value: object, base_dir: str, source: str, max_pixels: int, resize: bool,
               resize_max_pixels: int = DEFAULT_RESIZE_MAX_PIXELS) -> Image:
    """One image of a data row as an RGB PIL image: a path (relative to ``base_dir``, the data file's folder),
    base64 text (or a ``data:image/...;base64,`` URI), bytes, a ``{"bytes": ..., "path": ...}`` struct (parquet,
    datasets), or a PIL image. A missing, unreadable or truncated image is a one-line ``DataError`` naming
    ``source`` (file and row). So is one of more than ``max_pixels`` pixels, unless ``resize``: then it is scaled
    down to fit, if it has at most ``resize_max_pixels`` (the most gcore decodes; a larger one is refused, a
    possible decompression bomb). The size is read from the file's header, before anything is decoded: a
    20000x20000 PNG of 48 kB is refused without allocating its 400 million pixels."""
    from PIL import Image as PILImage

    if isinstance(value, PILImage.Image):
        image, name = value, "the image"
    else:
        data, name = _image_bytes(value, base_dir, source)
        image = _open_header(data, name, source)
    width, height = image.size
    pixels = width * height
    target = None
    if pixels > max_pixels:
        if not resize:
            raise DataError(f"{source}: {name} is {width}x{height} = {pixels} pixels, more than "
                            f"--data.max_image_pixels {max_pixels}; raise it, or --data.resize_images true")
        if pixels > resize_max_pixels and not _decoded(image):
            raise DataError(f"{source}: {name} is {width}x{height} = {pixels} pixels, more than "
                            f"--data.resize_max_pixels {resize_max_pixels}, the most gcore decodes to scale an image "
                            "down: refused (a possible decompression bomb); raise it if you trust the file")
        scale = (max_pixels / pixels) ** 0.5
        target = (max(1, int(width * scale)), max(1, int(height * scale)))
    if not _decoded(image):
        if target is not None:
            image.draft("RGB", target)  # JPEG: decodes at 1/2, 1/4 or 1/8 scale (still >= target); others: no-op
        try:
            image.load()  # decodes the whole file: a truncated one fails here, not inside a controller later
        except (OSError, ValueError, SyntaxError) as err:
            detail = " ".join(str(err).split()) or type(err).__name__
            raise DataError(f"{source}: {name}: not a readable image ({detail})") from None
    if target is not None:
        image = image.resize(target)
    return image.convert("RGB")


def _open_header(data: bytes, name: str, source: str) -> Image:
    """``Image.open`` of the bytes: it reads the header only (format, mode, size). Pillow's own
    decompression-bomb check (``Image.MAX_IMAGE_PIXELS``), which would raise inside ``open`` before gcore sees the
    size, is set aside meanwhile: gcore's limits apply (``read_image``)."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with _PILLOW_LIMIT:
            limit, PILImage.MAX_IMAGE_PIXELS = PILImage.MAX_IMAGE_PIXELS, None
            try:
                return PILImage.open(io.BytesIO(data))
            finally:
                PILImage.MAX_IMAGE_PIXELS = limit
    except UnidentifiedImageError:
        raise DataError(f"{source}: {name}: not a readable image (not a format Pillow reads)") from None
    except (OSError, ValueError, SyntaxError) as err:
        detail = " ".join(str(err).split()) or type(err).__name__
        raise DataError(f"{source}: {name}: not a readable image ({detail})") from None


def _decoded(image: Image) -> bool:
    """Whether the image's pixels are in memory (an image made in Python, or loaded), not only its header."""
    return getattr(image, "fp", None) is None and getattr(image, "im", None) is not None


def _image_bytes(value: object, base_dir: str, source: str) -> tuple[bytes, str]:
    """The encoded bytes of an image reference, and how to name it in an error."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return _image_bytes(value["bytes"], base_dir, source)
        if value.get("path"):
            return _image_bytes(str(value["path"]), base_dir, source)
        raise DataError(f"{source}: an image struct with neither 'bytes' nor 'path'")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), "the image bytes"
    if not isinstance(value, str) or not value:
        raise DataError(f"{source}: an image must be a path, base64 text or bytes, got {type(value).__name__}")
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        return _base64(payload, source), f"the {header} image"
    path = value if os.path.isabs(value) else os.path.join(base_dir, value)
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                return f.read(), path
        except OSError as err:
            raise DataError(f"{source}: {path}: cannot read: {err.strerror or err}") from None
    if len(value) > 64:  # no such file: base64 text, or a path after all when it is not base64 but looks like one
        try:
            return base64.b64decode(value, validate=True), "the base64 image"
        except (binascii.Error, ValueError):
            if not any(sep in value for sep in "/\\."):
                raise DataError(f"{source}: an image given as base64 text is not valid base64") from None
    raise DataError(f"{source}: image {path}: no such file (a path is relative to the data file's folder)")


def _base64(text: str, source: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise DataError(f"{source}: an image given as base64 text is not valid base64") from None


class ImageTokenProcessor:
    """The processor of a Qwen2-VL-style checkpoint made of its image processor and tokenizer: what
    transformers' ``Qwen2VLProcessor`` does for images (each image's placeholder token repeated once per
    merged patch), for where that class cannot be built (transformers 5 needs torchvision for its video
    processor) and for the embedded tiny VLM. Its chat template is the tokenizer's."""

    def __init__(self, image_processor: Any, tokenizer: Any, image_token: str = "<|image_pad|>") -> None:  # noqa: ANN401
        self.image_processor, self.tokenizer, self.image_token = image_processor, tokenizer, image_token
        self.chat_template = tokenizer.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=tokenize)

    def __call__(self, text: list[str], images: list[Image], return_tensors: str = "pt") -> dict[str, Any]:
        visual = dict(self.image_processor(images, return_tensors=return_tensors))
        merge = self.image_processor.merge_size ** 2
        counts = iter([int(grid.prod()) // merge for grid in visual["image_grid_thw"]])
        pieces = text[0].split(self.image_token)
        expanded = pieces[0] + "".join(self.image_token * next(counts) + piece for piece in pieces[1:])
        return {"input_ids": self.tokenizer([expanded], add_special_tokens=False)["input_ids"], **visual}


def load_processor(path: str, trust_remote_code: bool) -> Any:  # noqa: ANN401  a transformers processor
    """The processor of an image-text-to-text checkpoint folder: ``AutoProcessor``'s, or for a Qwen2-VL-style
    one that transformers cannot build here, an ``ImageTokenProcessor`` of its image processor and tokenizer."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        if hasattr(processor, "image_processor"):
            return processor
        error: Exception = ValueError("no image processor")
    except Exception as err:  # noqa: BLE001  transformers raises many error types; reported below
        error = err
    model_type = getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), "model_type", None)
    if model_type in QWEN_VL_TYPES:
        try:
            return ImageTokenProcessor(AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code),
                                       AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))
        except Exception as err:  # noqa: BLE001  reported below, in one line
            error = err
    raise ConfigError(f"--model.path {path}: cannot load an image processor for image prompts (the folder needs "
                      f"its processor files, e.g. preprocessor_config.json): {type(error).__name__}: "
                      f"{' '.join(str(error).split())[:300]}")


def encode(processor: Any, text: str, images: list[Image], source: str) -> tuple[list[int], VisualInputs]:  # noqa: ANN401
    """The token ids of one user message of ``images`` followed by ``text``, through the processor's chat
    template with the generation prompt, and the images' visual inputs."""
    if not getattr(processor, "chat_template", None):
        raise DataError(f"{source}: image prompts are placed through the processor's chat template, and this "
                        "model's processor has none")
    message = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    templated = processor.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    out = processor(text=[templated], images=images, return_tensors="pt")
    ids = out["input_ids"]
    token_ids = [int(t) for t in (ids[0].tolist() if isinstance(ids, torch.Tensor) else ids[0])]
    tensors = {key: torch.as_tensor(value) for key, value in out.items()
               if key not in ("input_ids", "attention_mask", "mm_token_type_ids") and value is not None}
    return token_ids, VisualInputs(tensors)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside Fabric's, DDP's or torch.compile's wrappers."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return model


def rope_model(model: torch.nn.Module) -> Any | None:  # noqa: ANN401  the HF module with ``get_rope_index``
    """The module of ``model`` that computes M-RoPE positions (Qwen2-VL's ``get_rope_index``), or ``None``."""
    model = _inner(model)
    for candidate in (model, getattr(model, "model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    return None


def multimodal_positions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         visual: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a model with M-RoPE, the 3D positions ``[3, B, L]`` of ``input_ids`` (padding by ``attention_mask``,
    left or right) and each row's delta ``[B, 1]``: a text token ``t`` tokens after the row's first real one is at
    position ``t + delta`` in all three dimensions. ``None`` for a model with 1D positions. The engine's decode
    continues from the prefill's deltas, the trainer recomputes them over prompt and response: the same positions."""
    rope = rope_model(model)
    if rope is None:
        return None
    config = rope.config
    image_token = getattr(config, "image_token_id", None)
    kwargs: dict[str, Any] = {"image_grid_thw": visual.get("image_grid_thw"), "attention_mask": attention_mask}
    if "mm_token_type_ids" in inspect.signature(rope.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = torch.eq(input_ids, image_token).int() if image_token is not None else \
            torch.zeros_like(input_ids, dtype=torch.int)
    if kwargs["image_grid_thw"] is None:  # no image in these rows: text positions
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return positions.unsqueeze(0).expand(3, -1, -1), torch.zeros_like(positions[:, :1])
    return rope.get_rope_index(input_ids, **kwargs)


def vision_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the vision encoder and its projector (``--backend.freeze_vision``): those under a module
    named ``visual``, ``vision_tower``, ``vision_model``, ``multi_modal_projector`` or ``connector``."""
    return [p for name, p in _inner(model).named_parameters() if set(name.split(".")) & set(VISION_MODULES)]
