"""gcore: a simple, scalable and balanced RL trainer for LLMs (after G-Core, arXiv 2507.22789).

Public API: the five plugin interfaces, the built-in plugins, the configs, and ``Trainer``/``fit``.
"""

# first, before anything imports torch: sets OpenMP's wait policy, which it reads once (docs/threads.md), and
# torch's C++ log level, read once too (docs/failure-modes.md)
from gcore import threads as _threads
from gcore.algorithms import DAPO, GRPO, PPO, RLOO, Algorithm, Distill, LossScale
from gcore.backends import TorchBackend, TrainingBackend
from gcore.data import DataConfig
from gcore.engines import Engine, HFEngine
from gcore.envs import Environment, Turn
from gcore.errors import AlgorithmError, ConfigError, DataError, GcoreError, PluginError, PluginExit, RewardError
from gcore.model import ModelConfig, ModelSource
from gcore.placement import DynamicPlacement, PlacementPolicy, StaticPlacement, Telemetry
from gcore.rewards import CallableReward, Judge, RegexReward, RewardModel, RuleReward, TargetCharReward
from gcore.rollout import RolloutJob
from gcore.trainer import FitResult, Trainer, TrainerConfig, fit
from gcore.types import Generation, Prompt, RolloutBatch, Sample, SamplingParams

_threads.forget_spin_count()  # torch is imported: libgomp has read it

__version__ = "0.1.0"

__all__ = [
    "DAPO",
    "GRPO",
    "PPO",
    "RLOO",
    "Algorithm",
    "AlgorithmError",
    "CallableReward",
    "ConfigError",
    "DataConfig",
    "DataError",
    "Distill",
    "DynamicPlacement",
    "Engine",
    "Environment",
    "FitResult",
    "GcoreError",
    "Generation",
    "HFEngine",
    "Judge",
    "LossScale",
    "ModelConfig",
    "ModelSource",
    "PlacementPolicy",
    "PluginError",
    "PluginExit",
    "Prompt",
    "RegexReward",
    "RewardError",
    "RewardModel",
    "RolloutBatch",
    "RolloutJob",
    "RuleReward",
    "Sample",
    "SamplingParams",
    "StaticPlacement",
    "TargetCharReward",
    "Telemetry",
    "TorchBackend",
    "Trainer",
    "TrainerConfig",
    "TrainingBackend",
    "Turn",
    "fit",
    "__version__",
]
