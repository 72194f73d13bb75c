"""The fixtures of the reliability review, built into a scratch folder.

``build(root)`` writes, under ``root``:

- ``good.jsonl`` (30 rows ``{"prompt": "7=", "answer": "7"}``), ``malformed.jsonl`` (bad line 16),
  ``fifo.jsonl`` (a named pipe that no one writes);
- ``rewards.py``: reward functions ``sysexit``, ``hang`` (``time.sleep(1)`` in a loop), ``busy`` (a pure-Python
  endless loop), ``bigint`` (``10**400``), ``huge`` (``2e300``), ``nan``;
- ``badenvs.py``: environment classes (``--env badenvs.<Class>`` with ``root`` on ``PYTHONPATH``): ``Raises``,
  ``ReturnsDict``, ``BadObs`` (observation an int), ``BadIds`` (token ids ``[10**9, -5]``), ``NeverEnds``,
  ``Huge`` (a 5,000,000-character observation each turn), ``Hangs`` (``time.sleep(10**6)`` in ``step``),
  ``Exits`` (``sys.exit(0)`` in ``step``), ``NanReward``;
- ``img/`` and ``img_*.jsonl``: a 56x56 PNG, a missing file, a PNG whose body is overwritten, a text file named
  ``.png``, a 20000x20000 1-bit PNG (about 48 kB), a 6000x6000 one, ``../../../../../../etc/passwd``,
  ``/etc/hostname``, ``http://127.0.0.1:9/x.png``;
- ``models/``: the embedded tiny model saved as a folder (``good``), ``remote_custom`` (``model_type``
  ``evil_model``, ``auto_map`` -> ``evil.py`` whose import touches a marker) and ``pklbin`` (only a
  ``pytorch_model.bin`` pickle whose payload touches a marker);
- ``marks/``: where every payload writes its marker (a marker there means code ran that should not have).

Nothing here runs a payload: the pickle is written with ``pickle.dumps`` of an object whose ``__reduce__`` names
``os.system``; loading it is what would run it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib

ROWS = [{"prompt": "7=", "answer": "7"}] * 30

REWARDS = '''"""Reward functions of the reliability review (``--reward python --reward.function rewards.py:NAME``)."""
import sys
import time


def sysexit(prompt, response, answer):
    sys.exit(0)


def hang(prompt, response, answer):
    while True:
        time.sleep(1)


def busy(prompt, response, answer):
    while True:
        pass


def bigint(prompt, response, answer):
    return 10**400


def huge(prompt, response, answer):
    return 2e300


def nan(prompt, response, answer):
    return float("nan")
'''

BADENVS = '''"""Environment classes of the reliability review (``--env badenvs.NAME``, this folder on PYTHONPATH)."""
import sys
import time

from gcore.envs import Environment, Turn


class Raises(Environment):
    def step(self, state, response):
        raise RuntimeError("env boom")


class ReturnsDict(Environment):
    def step(self, state, response):
        return {"observation": "x", "done": True}


class BadObs(Environment):
    def step(self, state, response):
        return Turn(observation=5)


class BadIds(Environment):
    def step(self, state, response):
        return Turn(observation=[10**9, -5])


class NeverEnds(Environment):
    def step(self, state, response):
        return Turn(observation="|7=")


class Huge(Environment):
    def step(self, state, response):
        return Turn(observation="x" * 5_000_000)


class Hangs(Environment):
    def step(self, state, response):
        time.sleep(10**6)
        return Turn(done=True)


class Exits(Environment):
    def step(self, state, response):
        sys.exit(0)


class NanReward(Environment):
    def step(self, state, response):
        return Turn(done=True, reward=float("nan"))
'''


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def bilevel_png(path: str, side: int) -> None:
    """A ``side`` x ``side`` all-black 1-bit PNG, compressed row by row (20000 x 20000 is about 48 kB)."""
    header = side.to_bytes(4, "big") * 2 + bytes([1, 0, 0, 0, 0])  # bit depth 1, greyscale
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte, then the packed bits
    squeeze = zlib.compressobj(9)
    parts = [squeeze.compress(row) for _ in range(side)]
    parts.append(squeeze.flush())
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", b"".join(parts))
                + _png_chunk(b"IEND", b""))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _jsonl(path: str, rows: list[dict]) -> None:
    _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def _images(root: str) -> None:
    from PIL import Image

    img = os.path.join(root, "img")
    os.makedirs(img, exist_ok=True)
    Image.new("RGB", (56, 56), (200, 30, 30)).save(os.path.join(img, "good.png"))
    Image.new("RGB", (56, 56), (30, 200, 30)).save(os.path.join(img, "corrupt.png"))
    with open(os.path.join(img, "corrupt.png"), "r+b") as f:  # keep the 8-byte signature and IHDR, spoil the rest
        size = f.seek(0, os.SEEK_END)
        f.seek(33)
        f.write(os.urandom(size - 33))
    _write(os.path.join(img, "notimage.png"), "this is text, not a PNG\n")
    bilevel_png(os.path.join(img, "bomb400m.png"), 20000)
    bilevel_png(os.path.join(img, "big36m.png"), 6000)
    rows = {
        "good": "img/good.png",
        "missing": "img/nope.png",
        "corrupt": "img/corrupt.png",
        "notimage": "img/notimage.png",
        "bomb": "img/bomb400m.png",
        "big": "img/big36m.png",
        "passwd": "../../../../../../etc/passwd",
        "abs": "/etc/hostname",
        "url": "http://127.0.0.1:9/x.png",
    }
    for name, image in rows.items():
        _jsonl(os.path.join(root, f"img_{name}.jsonl"), [{"prompt": "colour?", "answer": "red", "image": image}] * 8)


def _models(root: str) -> None:
    from gcore.model import ModelConfig, char_tokenizer, materialize

    models = os.path.join(root, "models")
    os.makedirs(models, exist_ok=True)
    marks = os.path.join(root, "marks")
    built = materialize(ModelConfig(), char_tokenizer(), 0, os.path.join(models, "build"))
    good = os.path.join(models, "good")
    shutil.copytree(built, good)
    custom = os.path.join(models, "remote_custom")
    shutil.copytree(good, custom)
    with open(os.path.join(custom, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "evil_model"
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    with open(os.path.join(custom, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    _write(os.path.join(custom, "evil.py"),
           f"import pathlib\npathlib.Path({os.path.join(marks, 'model_remote_custom')!r}).touch()\n"
           "from transformers import PretrainedConfig, PreTrainedModel\n"
           "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_model'\n"
           "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n")
    pklbin = os.path.join(models, "pklbin")
    shutil.copytree(good, pklbin)
    for name in os.listdir(pklbin):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(pklbin, name))

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {os.path.join(marks, 'model_pklbin')}",))

    with open(os.path.join(pklbin, "pytorch_model.bin"), "wb") as f:
        f.write(pickle.dumps({"model.embed_tokens.weight": Payload()}))


def build(root: str, models: bool = True, images: bool = True) -> str:
    """Write the fixtures under ``root`` (created); returns ``root``. Idempotent: an existing file is rewritten."""
    os.makedirs(root, exist_ok=True)
    os.makedirs(os.path.join(root, "marks"), exist_ok=True)
    _jsonl(os.path.join(root, "good.jsonl"), ROWS)
    lines = [json.dumps(r) for r in ROWS]
    lines[15] = '{"prompt": "7=" "answer": "7"}'
    _write(os.path.join(root, "malformed.jsonl"), "\n".join(lines) + "\n")
    fifo = os.path.join(root, "fifo.jsonl")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    _write(os.path.join(root, "rewards.py"), REWARDS)
    _write(os.path.join(root, "badenvs.py"), BADENVS)
    if images:
        _images(root)
    if models:
        _models(root)
    return root


def markers(root: str) -> set[str]:
    """The marker files now in ``root/marks``."""
    folder = os.path.join(root, "marks")
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gcore-reliability-fx"))


def _rehash(step: str, name: str) -> None:
    """Recompute ``name``'s entry in the checkpoint's manifest (the manifest is not signed)."""
    import hashlib

    manifest_path = os.path.join(step, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    with open(os.path.join(step, name), "rb") as f:
        data = f.read()
    manifest["files"][name] = {**manifest["files"].get(name, {}), "bytes": len(data),
                               "sha256": hashlib.sha256(data).hexdigest()}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)


def newest_checkpoint(run_root: str) -> str:
    import glob

    steps = sorted(p for p in glob.glob(os.path.join(run_root, "**", "step_*"), recursive=True)
                   if os.path.isdir(p) and not p.endswith(".tmp"))
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {run_root}")
    return steps[-1]


def tamper(run_root: str, how: str, marks: str) -> str:
    """Tamper with the newest checkpoint under ``run_root`` as the review's tamper.py did; returns its folder.

    ``truncate``: ``__0_0.distcp`` cut to 1,000,000 bytes (manifest kept: the loader must notice);
    ``rank0``: ``rank_0.pt`` replaced by a pickle whose payload touches ``marks/ckpt_rank0`` (manifest recomputed);
    ``metadata``: ``.metadata`` replaced by such a pickle (``marks/ckpt_metadata``; manifest recomputed);
    ``hf_custom``: ``hf/config.json`` names custom code, ``hf/evil_config.py`` touches ``marks/ckpt_hf_custom``.
    """
    step = newest_checkpoint(run_root)

    class Payload:
        def __init__(self, mark: str) -> None:
            self.mark = mark

        def __reduce__(self):
            return (os.system, (f"touch {os.path.join(marks, self.mark)}",))

    if how == "truncate":
        with open(os.path.join(step, "__0_0.distcp"), "r+b") as f:
            f.truncate(1_000_000)
    elif how == "rank0":
        import torch

        torch.save({"payload": Payload("ckpt_rank0")}, os.path.join(step, "rank_0.pt"))
        _rehash(step, "rank_0.pt")
    elif how == "metadata":
        with open(os.path.join(step, ".metadata"), "wb") as f:
            f.write(pickle.dumps(Payload("ckpt_metadata")))
        _rehash(step, ".metadata")
    elif how == "hf_custom":
        config_path = os.path.join(step, "hf", "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["model_type"] = "evil_model"
        config["auto_map"] = {"AutoConfig": "evil_config.EvilConfig", "AutoModelForCausalLM": "evil_config.EvilModel"}
        with open(config_path, "w") as f:
            json.dump(config, f, indent=1)
        _write(os.path.join(step, "hf", "evil_config.py"),
               f"import pathlib\npathlib.Path({os.path.join(marks, 'ckpt_hf_custom')!r}).touch()\n")
        with open(os.path.join(step, "manifest.json")) as f:
            listed = json.load(f)["files"]
        for name in ("hf/config.json", "hf/evil_config.py"):
            if name in listed:
                _rehash(step, name)
    else:
        raise ValueError(how)
    return step
