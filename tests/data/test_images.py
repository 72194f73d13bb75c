"""Image prompts in data files (``--data.image_key``): every way an image is given, and a one-line error naming the
file and row for every way it can be wrong; the visual task's split."""

import base64
import io
import json

import pytest
from PIL import Image

from gcore import ModelConfig
from gcore.data import DataConfig, check_images, load_eval_prompts, load_prompts
from gcore.errors import DataError
from gcore.model import load_tokenizer, materialize
from gcore.tasks import shape_colour_rows
from gcore.vision import load_processor


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    config = ModelConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64)
    path = materialize(config, load_tokenizer(config, vision=True), 0, str(tmp_path_factory.mktemp("vlm")), vision=True)
    return load_processor(path, trust_remote_code=False)


def _png(colour=(200, 0, 0), size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_paths_base64_and_lists_of_images_become_prompts_with_visual_inputs(tmp_path, processor):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png())
    encoded = base64.b64encode(_png((0, 0, 200))).decode()
    data = _write_jsonl(tmp_path / "data.jsonl", [
        {"prompt": "c=", "answer": "r", "image": "img/a.png"},  # relative to the data file's folder
        {"prompt": "c=", "answer": "b", "image": encoded},
        {"prompt": "two=", "answer": "r", "image": ["img/a.png", f"data:image/png;base64,{encoded}"]},
    ])
    config = DataConfig(path=data, image_key="image")
    check_images(config)
    prompts = load_prompts(config, processor.tokenizer, 8, None, processor)
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [p.token_ids.count(image_token) for p in prompts] == [4, 4, 8]  # 4 merged patches per 56x56 image
    assert [tuple(p.visual.tensors["image_grid_thw"].shape) for p in prompts] == [(1, 3), (1, 3), (2, 3)]
    assert prompts[0].metadata["image"] == "img/a.png"  # a reward gets the image's reference
    assert "image" not in prompts[1].metadata  # not base64 text
    assert prompts[0].token_ids == prompts[1].token_ids  # the same text and image size: only the images differ
    # --data.balance's cost model counts a prompt's image tokens with its text tokens
    from gcore.data import CostBalancer

    assert CostBalancer(prompts, n=2, max_new_tokens=8).prompt_lengths == [len(p.token_ids) for p in prompts]
    assert len(prompts[2].token_ids) - len(prompts[0].token_ids) >= 4 + 2


def test_parquet_binary_and_struct_columns(tmp_path, processor):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "data.parquet")
    pq.write_table(pa.table({"prompt": ["c=", "c="], "answer": ["r", "g"], "image": [_png(), _png((0, 200, 0))],
                             "struct": [{"bytes": _png(), "path": None}, {"bytes": _png(), "path": None}]}), path)
    for key in ("image", "struct"):
        prompts = load_prompts(DataConfig(path=path, image_key=key), processor.tokenizer, 8, None, processor)
        assert len(prompts) == 2 and all(p.visual is not None for p in prompts)


@pytest.mark.parametrize("case, message", [
    ("missing", r"data.jsonl:2: image .*nope.png: no such file"),
    ("truncated", r"data.jsonl:2: .*cut.png: not a readable image \(image file is truncated"),
    ("not_an_image", r"data.jsonl:2: .*text.png: not a readable image"),
    ("too_large", r"data.jsonl:2: .*big.png is 300x200 = 60000 pixels, more than --data.max_image_pixels 50000"),
    ("bad_base64", r"data.jsonl:2: an image given as base64 text is not valid base64"),
    ("no_key", r"data.jsonl:2: no 'image' key \(keys: prompt\) named in --data.image_key"),
])
def test_a_bad_image_is_one_line_naming_the_file_and_row(tmp_path, case, message):
    (tmp_path / "ok.png").write_bytes(_png())
    (tmp_path / "cut.png").write_bytes(_png(size=(64, 64))[:-40])
    (tmp_path / "text.png").write_text("not an image")
    (tmp_path / "big.png").write_bytes(_png(size=(300, 200)))
    second = {"missing": "nope.png", "truncated": "cut.png", "not_an_image": "text.png", "too_large": "big.png",
              "bad_base64": "!" * 100}
    row = {"prompt": "c="} if case == "no_key" else {"prompt": "c=", "image": second[case]}
    data = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "c=", "image": "ok.png"}, row])
    with pytest.raises(DataError, match=message) as error:
        check_images(DataConfig(path=data, image_key="image", max_image_pixels=50_000))
    assert "\n" not in str(error.value)


def test_resize_images_scales_a_large_image_down_instead(tmp_path, processor):
    (tmp_path / "big.png").write_bytes(_png(size=(300, 200)))
    data = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "c=", "image": "big.png"}])
    config = DataConfig(path=data, image_key="image", max_image_pixels=50_000, resize_images=True)
    check_images(config)
    assert len(load_prompts(config, processor.tokenizer, 8, None, processor)) == 1


def test_blank_images_keep_the_tokens_and_drop_what_the_image_shows(processor):
    real = load_prompts(DataConfig(task="shape_colour", num_synthetic_prompts=8), processor.tokenizer, 8, None,
                        processor)
    blank = load_prompts(DataConfig(task="shape_colour", num_synthetic_prompts=8, blank_images=True),
                         processor.tokenizer, 8, None, processor)
    assert [p.token_ids for p in real] == [p.token_ids for p in blank]
    assert len({p.visual.tensors["pixel_values"].sum().item() for p in blank}) == 1  # all alike
    assert len({p.visual.tensors["pixel_values"].sum().item() for p in real}) == 8


def test_shape_colour_has_a_held_out_split_and_balanced_answers(processor):
    train, test = shape_colour_rows(1000, 0, "train"), shape_colour_rows(64, 0, "test")
    assert not {r["image"].tobytes() for r in train} & {r["image"].tobytes() for r in test}
    assert {r["answer"] for r in test} == {"r", "g", "b", "y"}
    assert all(150 < sum(r["answer"] == c for r in train) < 350 for c in "rgby")
    held_out = load_eval_prompts(DataConfig(task="shape_colour", num_eval_prompts=16), processor.tokenizer, 8, None,
                                 processor)
    assert len(held_out) == 16 and all(p.visual is not None for p in held_out)


def _bilevel_png(width, height) -> bytes:
    """A valid 1-bit PNG of ``width`` x ``height`` white pixels, compressed as a bomb is (20000x20000: ~48 kB),
    written without ever holding its pixels."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    packer, row = zlib.compressobj(9), b"\0" + b"\xff" * ((width + 7) // 8)
    body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bomb")
    (folder / "bomb.png").write_bytes(_bilevel_png(20000, 20000))
    return folder


@pytest.mark.parametrize("resize, message", [
    (False, r"data.jsonl:1: .*bomb.png is 20000x20000 = 400000000 pixels, more than --data.max_image_pixels "
            r"16777216; raise it, or --data.resize_images true$"),
    (True, r"data.jsonl:1: .*bomb.png is 20000x20000 = 400000000 pixels, more than --data.resize_max_pixels "
           r"89478485, the most gcore decodes to scale an image down: refused \(a possible decompression bomb\)"),
])
def test_a_decompression_bomb_is_refused_from_its_header_in_one_line(bomb, resize, message):
    """Pillow's own ``DecompressionBombError`` (a traceback) fired inside ``Image.open`` before gcore's check;
    gcore's limits now apply, read from the header, with or without ``--data.resize_images``."""
    from PIL import Image as PILImage

    assert (bomb / "bomb.png").stat().st_size < 100_000
    limit = PILImage.MAX_IMAGE_PIXELS
    data = _write_jsonl(bomb / "data.jsonl", [{"prompt": "c=", "image": "bomb.png"}])
    with pytest.raises(DataError, match=message) as error:
        check_images(DataConfig(path=data, image_key="image", resize_images=resize))
    assert "\n" not in str(error.value)
    assert PILImage.MAX_IMAGE_PIXELS == limit  # Pillow's setting is put back


@pytest.mark.parametrize("kind", ["png", "jpeg"])
def test_resize_images_scales_a_large_image_within_the_decode_limit(tmp_path, kind):
    """6 Mpx (over a 50,000-pixel --data.max_image_pixels, under --data.resize_max_pixels): decoded and scaled
    down to fit; a JPEG is decoded at a reduced scale first (``draft``)."""
    from gcore.vision import read_image

    if kind == "png":
        (tmp_path / "big.png").write_bytes(_bilevel_png(3000, 2000))
    else:
        Image.new("RGB", (3000, 2000), (10, 200, 30)).save(tmp_path / "big.png", format="JPEG")
    image = read_image("big.png", str(tmp_path), "data.jsonl:1", 50_000, True)
    assert image.mode == "RGB" and image.size == (273, 182) and image.size[0] * image.size[1] <= 50_000
    with pytest.raises(DataError, match="more than --data.resize_max_pixels 1000000"):
        read_image("big.png", str(tmp_path), "data.jsonl:1", 50_000, True, resize_max_pixels=1_000_000)


@pytest.mark.integration
def test_a_bomb_is_one_line_through_the_cli(bomb, tmp_path):
    """``gcore fit`` with the 20000x20000 PNG: exit 2, one ``gcore: error:`` line (was: a 35-line traceback). Through
    the CLI's ``main`` in this process (a fresh one would only import gcore again): an exception ``main`` does not
    turn into its line fails the test."""
    from conftest import run_gcore_here

    data = _write_jsonl(bomb / "rows.jsonl", [{"prompt": "c=", "answer": "r", "image": "bomb.png"}])
    run = run_gcore_here("fit", "--data.path", data, "--data.image_key", "image", "--data.resize_images", "true",
                    "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert "Traceback" not in run.stderr and len([line for line in lines if "gcore: error:" in line]) == 1
    assert "bomb.png is 20000x20000 = 400000000 pixels" in run.stderr
