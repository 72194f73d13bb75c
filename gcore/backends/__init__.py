"""Training backends: ``TrainingBackend`` and its implementations (``torch``; ``megatron``)."""

from gcore.backends.base import TrainingBackend
from gcore.backends.common import OptimizerOptions, token_logprobs
from gcore.backends.torch import TorchBackend

__all__ = ["OptimizerOptions", "TorchBackend", "TrainingBackend", "token_logprobs"]
