"""Notebook-style use: subclass one method of GRPO and pass it in."""

import torch

import gcore
from gcore import GRPO, DataConfig, ModelConfig, SamplingParams, Trainer, TrainerConfig


class SignAdvantageGRPO(GRPO):
    """Advantages are only the sign of (reward - group mean)."""

    calls = 0

    def advantages(self, batch):
        SignAdvantageGRPO.calls += 1
        return torch.sign(super().advantages(batch))


def test_subclassing_one_method_changes_training(tmp_path):
    algorithm = SignAdvantageGRPO()
    result = Trainer(
        trainer=TrainerConfig(max_steps=3, default_root_dir=str(tmp_path), enable_progress_bar=False),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(prompts_per_step=4),
        sampling=SamplingParams(n=4, max_new_tokens=6),
        algorithm=algorithm,
    ).fit()
    assert SignAdvantageGRPO.calls == 3
    assert len(result.history) == 3
    assert result.final_model_dir is not None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(result.final_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(result.final_model_dir)
    assert model.config.num_hidden_layers == 1 and tokenizer.decode(tokenizer("7=")["input_ids"]) == "7="


def test_public_api_names():
    for name in ("Engine", "RewardModel", "Algorithm", "PlacementPolicy", "TrainingBackend", "GRPO", "HFEngine",
                 "TorchBackend", "StaticPlacement", "TargetCharReward", "CallableReward", "Trainer", "fit"):
        assert hasattr(gcore, name), name
        assert name in gcore.__all__
