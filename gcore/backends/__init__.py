"""Training backends: ``TrainingBackend`` and its implementations (``torch``; ``megatron``)."""

from gcore.backends.base import TrainingBackend
from gcore.backends.common import OptimizerConfig, token_logprobs
from gcore.backends.torch import TorchBackend

__all__ = ["OptimizerConfig", "TorchBackend", "TrainingBackend", "token_logprobs"]
