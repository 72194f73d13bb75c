"""Rollout engines: ``Engine`` and its implementations (``hf``; ``vllm`` and ``sglang`` on GPUs)."""

from gcore.engines.base import Engine
from gcore.engines.hf import HFEngine

__all__ = ["Engine", "HFEngine"]
