"""The visual task's step on the embedded tiny VLM: time per stage, peak memory, and the vision tower's share
of the model's work as the images grow.

For each image side S (pixels; the tiny VLM's patches are 14 pixels, merged 2x2, so an image is (S/28)^2
tokens), this writes the tiny VLM with an image processor that resizes every image to S x S, and the
``shape_colour`` rows with their images drawn at S x S as PNG files, then:

1. runs ``gcore fit`` on them (GRPO, ``target_char``, the hf engine in the controller's process) and reports the
   median time of each stage over the steps after the first, and the run's peak resident memory;
2. times, in this process with one torch thread, one forward and backward pass of the model over a batch of the
   prompts with a 16-token response, and the vision encoder's own forward and backward on the same images: the
   vision share is the second over the first.

    python benchmarks/visual_step.py --sizes 56 112 224 --steps 6

Each size takes about a minute on a 2-core CPU at 56 pixels, more at larger sizes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGES = ("generate", "reward", "prepare", "train", "sync")


def write_model(side: int, workdir: Path) -> str:
    """The embedded tiny VLM, its image processor resizing every image to ``side`` x ``side``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from gcore.model import ModelConfig, load_tokenizer, materialize

    config = ModelConfig()
    tokenizer = load_tokenizer(config, vision=True)
    path = materialize(config, tokenizer, seed=0, workdir=str(workdir), vision=True)
    processor = Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=side * side, patch_size=14,
                                         merge_size=2, temporal_patch_size=2)
    processor.save_pretrained(path)
    return path


def write_data(side: int, rows: int, workdir: Path) -> str:
    """``rows`` shape_colour rows as jsonl, their images drawn at ``side`` pixels (nearest: sharp edges)."""
    from PIL import Image

    from gcore.tasks import shape_colour_rows

    path = workdir / "data.jsonl"
    with path.open("w") as f:
        for i, row in enumerate(shape_colour_rows(rows, seed=0)):
            name = f"image{i}.png"
            row["image"].resize((side, side), Image.Resampling.NEAREST).save(workdir / name)
            f.write(json.dumps({"prompt": row["prompt"], "answer": row["answer"], "image": name}) + "\n")
    return str(path)


def fit(model: str, data: str, steps: int, root: Path, extra: list[str]) -> dict[str, float]:
    """Median seconds per stage (steps after the first) and the run's peak RSS in GB."""
    command = [sys.executable, "-m", "gcore", "fit", "--model.path", model, "--data.path", data,
               "--data.image_key", "image", "--data.prompt_key", "prompt", "--data.answer_key", "answer",
               "--reward", "target_char", "--algorithm", "grpo", "--placement", "static",
               "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(root),
               "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false", *extra]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)  # this run's own peak (and its waited-for children's)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"gcore fit failed ({child.returncode}): {' '.join(command)}")
    rows = list(csv.DictReader(next(root.rglob("metrics.csv")).open()))
    rows = [r for r in rows if r.get("time/step")][1:]
    out = {stage: statistics.median(float(r[f"time/{stage}"]) for r in rows if r.get(f"time/{stage}"))
           for stage in STAGES if any(r.get(f"time/{stage}") for r in rows)}
    out["step"] = statistics.median(float(r["time/step"]) for r in rows)
    out["peak_rss_gb"] = usage.ru_maxrss / 1e6  # kB on Linux
    return out


def vision_share(model_path: str, data: str, batch: int, reps: int) -> dict[str, float]:
    """One forward and backward of the whole model over ``batch`` prompts (+16 response tokens) against the
    vision encoder's alone on their images, one torch thread; medians over ``reps``."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from gcore.types import concat_visual
    from gcore.vision import encode, load_processor, multimodal_positions

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(model_path, trust_remote_code=False)
    processor = load_processor(model_path, trust_remote_code=False)
    base = Path(data).parent
    rows = [json.loads(line) for line in Path(data).open()][:batch]
    encoded = [encode(processor, r["prompt"], [Image.open(base / r["image"]).convert("RGB")], "row") for r in rows]
    ids = torch.tensor([token_ids + [5] * 16 for token_ids, _ in encoded])
    visual = concat_visual([v for _, v in encoded])
    visual_module = model.model.visual
    mask = torch.ones_like(ids)
    rope = multimodal_positions(model, ids, mask, visual)  # the M-RoPE positions gcore's trainer uses
    positions = {} if rope is None else {"position_ids": rope[0]}

    def whole() -> None:
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids, **positions, **visual).loss.backward()

    def tower() -> None:
        model.zero_grad()
        out = visual_module(visual["pixel_values"], grid_thw=visual["image_grid_thw"])
        hidden = out.pooler_output if hasattr(out, "pooler_output") else out
        hidden = hidden[0] if isinstance(hidden, (tuple, list)) else hidden
        hidden.float().pow(2).mean().backward()

    times = {}
    for name, fn in (("whole_s", whole), ("vision_s", tower)):
        fn()  # warm-up
        samples = []
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        times[name] = statistics.median(samples)
    times["image_tokens"] = int(visual["image_grid_thw"][0].prod()) // 4
    times["share"] = times["vision_s"] / times["whole_s"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[56, 112, 224], help="image sides (multiples of 28)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=64, help="prompts in the data file")
    parser.add_argument("--batch", type=int, default=16, help="prompts in the timed forward/backward")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("fit_args", nargs="*", help="more gcore fit arguments (after --)")
    args = parser.parse_args()
    for side in args.sizes:
        if side % 28:
            parser.error(f"--sizes: {side} is not a multiple of 28 (14-pixel patches merged 2x2)")
    print(f"{os.uname().machine}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    results = {}
    for side in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            model = write_model(side, workdir / "model")
            (workdir / "data").mkdir()
            data = write_data(side, args.rows, workdir / "data")
            stages = fit(model, data, args.steps, workdir / "runs", args.fit_args)
            share = vision_share(model, data, args.batch, args.reps)
            results[side] = {**stages, **share}
            print(f"  {side}px done (load {os.getloadavg()[0]:.1f})", flush=True)
    header = ["image", "tokens/image", *[f"{s} s" for s in STAGES], "step s", "peak RSS GB",
              "fwd+bwd whole s", "vision s", "vision share"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for side, r in results.items():
        cells = [f"{side}x{side}", str(r["image_tokens"]), *[f"{r.get(s, float('nan')):.3f}" for s in STAGES],
                 f"{r['step']:.3f}", f"{r['peak_rss_gb']:.2f}", f"{r['whole_s']:.4f}", f"{r['vision_s']:.4f}",
                 f"{r['share']:.1%}"]
        print("| " + " | ".join(cells) + " |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
