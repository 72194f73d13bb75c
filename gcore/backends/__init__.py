"""Training backends: ``TrainingBackend`` and its implementations (``torch``; ``megatron``)."""

from gcore.backends.base import TrainingBackend
from gcore.backends.torch import TorchBackend, token_logprobs

__all__ = ["TorchBackend", "TrainingBackend", "token_logprobs"]
