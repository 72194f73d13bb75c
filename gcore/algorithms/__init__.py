"""RL algorithms: ``Algorithm`` and its implementations."""

from gcore.algorithms.base import Algorithm, LossScale, aggregate, group_normalize, kl_estimate
from gcore.algorithms.grpo import GRPO

__all__ = ["GRPO", "Algorithm", "LossScale", "aggregate", "group_normalize", "kl_estimate"]
