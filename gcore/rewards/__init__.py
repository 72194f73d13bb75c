"""Reward models: ``RewardModel`` and its implementations."""

from gcore.rewards.base import RewardModel, RuleReward
from gcore.rewards.rule import CallableReward, RegexReward, TargetCharReward

__all__ = ["CallableReward", "RegexReward", "RewardModel", "RuleReward", "TargetCharReward"]
