"""Lets a CUDA-built torchvision import next to a CPU-only torch.

The package registry's torchvision is built against CUDA torch: next to a CPU torch its ``_C``
extension does not load, so its operators (``torchvision::nms`` ...) are never defined, and
``import torchvision`` then dies in ``torchvision/_meta_registrations.py``, which registers fake
kernels for ``nms`` and ``qnms`` without checking that they exist (``RuntimeError: operator
torchvision::nms does not exist``). SGLang 0.5.15 imports torchvision at start-up (``torchvision.io``),
in the calling process and in each process it spawns, so SGLang's CPU engine cannot start.

torch calls every ``torch.backends`` entry point at the end of ``import torch``; this one, installed
only into SGLang's environment by gcore's ``scripts/install_sglang_cpu.sh``, defines the schemas of
those two operators when torchvision's own extension does not load. Nothing else changes: the
operators have no kernels, so calling them still fails, and a torchvision whose extension loads is
left alone.
"""

from __future__ import annotations

import importlib.util
import os

# torchvision 0.28's schemas of the two operators its _meta_registrations registers unconditionally
SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_library = None  # the definitions live as long as this object


def define_missing_ops() -> None:
    """Define ``torchvision::nms``/``qnms`` when torchvision is installed but its extension cannot load."""
    global _library
    spec = importlib.util.find_spec("torchvision")
    if _library is not None or spec is None or not spec.submodule_search_locations:
        return
    import torch

    extension = os.path.join(next(iter(spec.submodule_search_locations)), "_C.so")
    if not os.path.exists(extension):
        return
    try:
        torch.ops.load_library(extension)  # what torchvision does first; a matching build defines its ops
        return
    except (OSError, ImportError):
        pass
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        _library.define(schema)
