"""``gcore export``: a checkpoint's policy as a plain HF checkpoint, built from the checkpoint's ``hf/`` folder and
its DCP ``model`` state, without running code from the checkpoint."""

from __future__ import annotations

import json
import os

from gcore.checkpoint.files import HF_FILES, CheckpointError, copy_processor_files, verify
from gcore.checkpoint.safe_load import dcp_load
from gcore.errors import GcoreError


def export_hf(checkpoint: str, out_dir: str, trust_remote_code: bool = False) -> str:
    """Write the policy of a checkpoint as a plain HF checkpoint (``save_pretrained``).

    The checkpoint's ``hf/`` folder (config and tokenizer, saved with it) describes the model;
    the weights come from the DCP ``model`` state, whatever rank count wrote it. No code from the
    checkpoint runs: config, model and tokenizer load with ``trust_remote_code=False`` (transformers
    never prompts), and an ``hf/`` folder that names code of its own (``auto_map``) is refused unless
    ``trust_remote_code`` (``gcore export --trust-remote-code``, the user's choice, not the checkpoint's).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    hf_dir = os.path.join(checkpoint, HF_FILES)
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{checkpoint}: no {HF_FILES}/ folder with the model's config")
    for name in ("config.json", "tokenizer_config.json"):
        file = os.path.join(hf_dir, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file) as f:
                auto_map = json.load(f).get("auto_map")
        except (OSError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{file}: not a JSON object ({err})") from None
        if auto_map and not trust_remote_code:
            classes = ", ".join(map(str, auto_map.values() if isinstance(auto_map, dict) else auto_map))
            raise CheckpointError(f"{file} names custom code ({classes}): gcore export runs no code from a "
                                  "checkpoint; pass --trust-remote-code only if you trust this checkpoint's code")
    verify(checkpoint)
    try:
        config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
        image_text = getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        auto_class = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
        model = auto_class.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{hf_dir}: cannot build the model from its config: {type(err).__name__}: "
                              f"{' '.join(str(err).split())}") from None
    state = {"model": model.state_dict()}
    dcp_load(state, checkpoint)
    model.load_state_dict(state["model"])
    model.save_pretrained(out_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  a checkpoint saved without a tokenizer still exports its weights
        pass
    else:
        tokenizer.save_pretrained(out_dir)
    copy_processor_files(hf_dir, out_dir)  # an image-text-to-text model's processor (AutoProcessor loads it)
    return out_dir


def export_main(argv) -> int:  # noqa: ANN001
    """``gcore export CHECKPOINT --to hf DIR [--trust-remote-code]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="gcore export", description="Export a checkpoint's policy.")
    parser.add_argument("checkpoint", help="a checkpoint folder (e.g. .../checkpoints/step_00000010)")
    parser.add_argument("--to", nargs=2, metavar=("FORMAT", "DIR"), required=True, help="hf DIR")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a checkpoint whose config names code of its own (auto_map) and run that code; "
                        "off by default: export runs no code from the checkpoint")
    args = parser.parse_args(list(argv))
    fmt, out_dir = args.to
    if fmt != "hf":
        raise GcoreError(f"gcore export --to {fmt}: valid formats: hf")
    print(f"wrote {export_hf(args.checkpoint.rstrip('/'), out_dir, args.trust_remote_code)}")
    return 0
