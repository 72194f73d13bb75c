"""Image prompts and checkpoints: a run of the visual task resumes, and both its ``final/`` folder and ``gcore export
--to hf`` of a checkpoint are image-text-to-text checkpoints that transformers loads, with their image processor."""

import os

import torch

from gcore import Trainer, TrainerConfig
from gcore.checkpoint import export_hf
from gcore.data import DataConfig


def _fit(root, steps, **trainer):
    return Trainer(trainer=TrainerConfig(max_steps=steps, default_root_dir=str(root), enable_progress_bar=False,
                                         checkpoint_every=1, async_checkpoint=False, **trainer),
                   data=DataConfig(task="shape_colour", prompts_per_step=4)).fit()


def test_a_visual_run_resumes_and_exports_an_image_text_to_text_checkpoint(tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    first = _fit(tmp_path, 2)
    resumed = _fit(tmp_path, 3, resume="auto")
    assert [m["step"] for m in resumed.history] == [2]  # step 2 (0-based): the one after the checkpoint
    checkpoints = sorted(os.listdir(tmp_path / "gcore" / "checkpoints"))
    out = export_hf(str(tmp_path / "gcore" / "checkpoints" / checkpoints[-1]), str(tmp_path / "exported"))
    for folder in (first.final_model_dir, resumed.final_model_dir, out):
        assert folder is not None
        model = AutoModelForImageTextToText.from_pretrained(folder)
        assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
        assert AutoImageProcessor.from_pretrained(folder).merge_size == 2
        assert AutoTokenizer.from_pretrained(folder).chat_template
    exported = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    final = AutoModelForImageTextToText.from_pretrained(resumed.final_model_dir).state_dict()
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[name], final[name]) for name in final)
