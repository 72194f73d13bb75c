"""RL algorithms: ``Algorithm`` and its implementations."""

from gcore.algorithms.base import Algorithm, LossScale, aggregate, gae, group_normalize, kl_estimate
from gcore.algorithms.dapo import DAPO
from gcore.algorithms.distill import Distill
from gcore.algorithms.grpo import GRPO
from gcore.algorithms.ppo import PPO
from gcore.algorithms.rloo import RLOO

__all__ = [
    "DAPO", "GRPO", "PPO", "RLOO", "Algorithm", "Distill", "LossScale", "aggregate", "gae", "group_normalize",
    "kl_estimate",
]
