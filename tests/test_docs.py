import importlib.util
from pathlib import Path

import gcore

ROOT = Path(__file__).resolve().parents[1]

#: the public API; removing a name is a breaking change and must fail this test
PUBLIC_API = {
    "Algorithm", "CallableReward", "ConfigError", "DataConfig", "DataError", "DynamicPlacement", "Engine",
    "FitResult", "GRPO", "GcoreError", "Generation", "HFEngine", "LossScale", "ModelConfig", "PlacementPolicy",
    "PluginError", "Prompt", "RegexReward", "RewardError", "RewardModel", "RolloutBatch", "RuleReward", "Sample",
    "SamplingParams", "StaticPlacement", "TargetCharReward", "Telemetry", "TorchBackend", "Trainer",
    "TrainerConfig", "TrainingBackend", "fit", "__version__",
}


def test_public_api_is_stable():
    missing = PUBLIC_API - set(gcore.__all__)
    assert not missing, f"public names removed: {sorted(missing)}"
    for name in gcore.__all__:
        assert hasattr(gcore, name), name


def test_cli_reference_is_generated_from_the_code():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "docs" / "generate_cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "cli.md").read_text() == module.render(), (
        "docs/cli.md is stale: run python docs/generate_cli_reference.py > docs/cli.md"
    )
