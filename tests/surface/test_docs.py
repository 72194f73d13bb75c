import subprocess
import sys
from pathlib import Path

import pytest

import gcore

ROOT = Path(__file__).resolve().parents[2]

#: the public API; removing a name is a breaking change and must fail this test
PUBLIC_API = {
    "Algorithm", "CallableReward", "ConfigError", "DataConfig", "DataError", "DynamicPlacement", "Engine",
    "FitResult", "GRPO", "GcoreError", "Generation", "HFEngine", "Judge", "LossScale", "ModelConfig",
    "ModelSource", "PlacementPolicy", "PluginError", "PluginExit", "Prompt", "RegexReward", "RewardError",
    "RewardModel", "RolloutBatch", "RolloutJob", "RuleReward", "Sample", "SamplingParams", "StaticPlacement",
    "TargetCharReward", "Telemetry", "TorchBackend", "Trainer", "TrainerConfig", "TrainingBackend", "fit",
    "__version__",
}


def test_public_api_is_stable():
    missing = PUBLIC_API - set(gcore.__all__)
    assert not missing, f"public names removed: {sorted(missing)}"
    for name in gcore.__all__:
        assert hasattr(gcore, name), name


@pytest.mark.integration
def test_cli_reference_is_generated_from_the_code():
    # a fresh interpreter: classes defined by other tests must not appear as "known subclasses"
    rendered = subprocess.run([sys.executable, str(ROOT / "docs" / "generate_cli_reference.py")],
                              capture_output=True, text=True, check=True).stdout
    assert (ROOT / "docs" / "cli.md").read_text() == rendered, (
        "docs/cli.md is stale: run python docs/generate_cli_reference.py > docs/cli.md"
    )
