"""Reward models: ``RewardModel`` and its implementations."""

from gcore.rewards.base import Judge, RewardModel, RuleReward
from gcore.rewards.rule import CallableReward, RegexReward, TargetCharReward

__all__ = ["CallableReward", "Judge", "RegexReward", "RewardModel", "RuleReward", "TargetCharReward"]
