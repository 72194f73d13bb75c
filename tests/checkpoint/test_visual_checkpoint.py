"""Image prompts and checkpoints: a run of the visual task resumes, and both its ``final/`` folder and ``gcore export
--to hf`` of a checkpoint are image-text-to-text checkpoints that transformers loads, with their image processor."""

import os

import pytest
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


def test_the_exported_folder_loads_with_autoprocessor_and_gives_the_training_inputs(tmp_path):
    """Where torchvision is installed (transformers 5 needs it for Qwen2-VL's processor: the vLLM CI venv, with
    gcore's CPU shim), ``AutoProcessor`` loads the run's ``final/`` folder and turns an image prompt into the same
    token ids and pixel values as gcore's ``ImageTokenProcessor``, which the run trained on."""
    pytest.importorskip("torchvision", reason="transformers 5 builds Qwen2-VL's AutoProcessor with torchvision only")
    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from gcore.vision import ImageTokenProcessor, encode

    final = _fit(tmp_path, 1).final_model_dir
    assert final is not None
    auto = AutoProcessor.from_pretrained(final)
    assert type(auto).__name__ == "Qwen2VLProcessor"
    ours = ImageTokenProcessor(AutoImageProcessor.from_pretrained(final), AutoTokenizer.from_pretrained(final))
    images = [Image.new("RGB", (56, 56), (220, 40, 40)), Image.new("RGB", (84, 56), (40, 70, 220))]
    ids, visual = encode(auto, "two=", images, "row 0")
    want_ids, want = encode(ours, "two=", images, "row 0")
    assert ids == want_ids
    assert visual.tensors.keys() >= {"pixel_values", "image_grid_thw"}
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(visual.tensors[key], want.tensors[key]), key
