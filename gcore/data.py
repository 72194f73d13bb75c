"""Prompt datasets: reading jsonl/parquet files, tokenizing once, and each step's shard per rank."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from gcore.balance import LengthPredictor, imbalance, karmarkar_karp, round_robin
from gcore.errors import DataError
from gcore.tasks import CANVAS_COLOUR, TASK_IMAGE_KEY, TASK_METADATA, TASKS, VISUAL_TASKS
from gcore.types import Prompt, Sample, VisualInputs


@dataclass
class DataConfig:
    """Where prompts come from and how many each step takes.

    Args:
        path: a ``.jsonl`` or ``.parquet`` file, or a folder saved with ``datasets``'
            ``save_to_disk``. Unset: the embedded task named by ``task``.
        task: the embedded task when ``path`` is unset: ``target_char`` (for the embedded tiny model),
            ``arithmetic`` (addition/subtraction word problems, for the ``math`` reward), ``compare``
            (which of two numbers is larger or smaller, for the ``math`` reward) or ``mixed`` (compare
            questions, metadata ``reward: math``, among open-ended prompts for a generative judge,
            ``reward: judge``; for the ``routed`` reward) or ``reveal`` (the multi-turn task of ``--env reveal``:
            the prompt ``?=`` hides the digit that the environment reveals after the first turn); the tasks of the
            real-model suite (``benchmarks/task_suite.py``), all for the ``math`` reward: ``count_letter`` (how many
            times a letter appears in a word), ``middle`` (the middle one of three numbers), ``multiply`` (a number
            times a single digit), ``count_even`` (how many of four numbers are even), ``digit_sum`` (the sum of a
            number's digits, answered inside ``\\boxed{}``); ``shape_colour``, the visual task (image prompts, for the
            embedded tiny VLM and the ``target_char`` reward: the colour of a shape on a 56-pixel canvas, answered
            by the colour's first letter; docs/multimodal.md); ``number_only`` ("What is N + 1? Answer with the
            number only.", 4-digit N with ``--data.task_digits [4, 4]``; its reward is not ``math`` but
            ``gcore.tasks.number_only_reward``: ``--reward python --reward.function FILE:score`` with a ``score(prompt,
            response, answer)`` that returns it; benchmarks/results/parity.md).
        task_digits: the number sizes in digits of every embedded task with numbers (all but ``target_char``,
            ``reveal`` and ``count_letter``), ``[fewest, most]``:
            ``[2, 3]`` draws 10-999; ``[1, 2]`` (1-99) is an arithmetic level a 135M-parameter instruct model
            sometimes solves.
        task_judged_share: the ``mixed`` task's share of judged prompts, ``[first, last]``: linear over the
            prompts' order, e.g. ``[0.1, 0.9]``; ``--data.shuffle false`` keeps that order, so the share
            rises over the run (shuffled, every step holds about the mean share).
        prompt_key: the column holding the prompt text.
        answer_key: the column holding the reference answer (optional per row).
        metadata_keys: columns copied into each prompt's ``metadata`` (which e.g. the ``routed`` reward
            reads); every row must have them.
        prompt_template: a format string applied to each prompt, e.g. ``"Q: {prompt}\\nA:"``.
        chat_template: wrap each (templated) prompt as a user message with the tokenizer's own chat
            template (``apply_chat_template`` with the generation prompt).
        prompts_per_step: prompts per training step over all controllers (each yields ``sampling.n``
            samples).
        shuffle: reshuffle the prompts every epoch (``false``: the file's order, every epoch).
        balance: split each step's prompts over the controllers by predicted cost (Karmarkar-Karp
            on prompt length + learnt response length) instead of round robin.
        num_synthetic_prompts: size of the embedded task's prompt set.
        eval_path: held-out prompts (same format and keys as ``path``) for ``--trainer.eval_every`` and
            ``gcore eval``. Unset: the embedded task's held-out split when ``path`` is unset.
        num_eval_prompts: how many held-out prompts to evaluate on (the first ones).
        image_key: the column holding each row's image, or a list of images: a path (relative to the data file's
            folder), base64 text, or bytes (a parquet binary column, or a ``{"bytes": ...}`` struct). The images
            are placed before the prompt's text through the processor's chat template; the model must be an
            image-text-to-text checkpoint (unset ``--model.path``: the embedded tiny VLM). See docs/multimodal.md.
        max_image_pixels: refuse (one line naming the file and row) an image of more pixels than this.
        resize_images: scale an image of more than ``max_image_pixels`` pixels down to fit instead of refusing it
            (up to ``resize_max_pixels``). Image sizes are read from the file's header, before decoding.
        resize_max_pixels: with ``resize_images``, the most pixels gcore decodes to scale an image down; a larger
            image is refused in one line (a possible decompression bomb: a 20000x20000 PNG can be 48 kB).
        blank_images: replace every image by a uniform grey one of the same size (the control that shows whether
            a policy uses its images: the prompts' tokens are the same, the images tell nothing).
        synthetic_feature_mb: attach to every prompt a synthetic per-sample feature of this many MB (an
            image stand-in, made by the controller that takes the prompt) that travels with its samples
            to generation and training; for benchmarks of data movement (the text models ignore it).
    """

    path: str | None = None
    task: Literal["target_char", "arithmetic", "compare", "mixed", "reveal", "count_letter", "middle", "multiply",
                  "count_even", "digit_sum", "shape_colour", "number_only"] = "target_char"
    task_digits: tuple[int, int] = (2, 3)
    task_judged_share: tuple[float, float] = (0.1, 0.9)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    metadata_keys: list[str] = field(default_factory=list)
    prompt_template: str = "{prompt}"
    chat_template: bool = False
    prompts_per_step: int = 16
    shuffle: bool = True
    balance: bool = True
    num_synthetic_prompts: int = 1000
    image_key: str | None = None
    max_image_pixels: int = 4096 * 4096
    resize_images: bool = False
    resize_max_pixels: int = 89_478_485  # gcore.vision.DEFAULT_RESIZE_MAX_PIXELS, Pillow's own bomb limit
    blank_images: bool = False
    synthetic_feature_mb: float = 0.0
    eval_path: str | None = None
    num_eval_prompts: int = 64

    @property
    def has_images(self) -> bool:
        """Whether the prompts carry images: ``image_key`` is set, or the embedded task is a visual one."""
        return self.image_key is not None or (self.path is None and self.task in VISUAL_TASKS)

    @property
    def images_column(self) -> str | None:
        """The rows' column of images: ``image_key``, or the visual task's."""
        if self.image_key is not None:
            return self.image_key
        return TASK_IMAGE_KEY if self.path is None and self.task in VISUAL_TASKS else None


def check_tokenizer(config: DataConfig, tokenizer) -> None:  # noqa: ANN001  a transformers tokenizer
    """The data options that need the tokenizer, checked once before any controller starts (each controller
    would otherwise fail with it while loading its prompts)."""
    if config.chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError("--data.chat_template true: the tokenizer has no chat template; use a model whose "
                        "tokenizer has one, or --data.chat_template false (--data.prompt_template formats prompts)")


def with_synthetic_feature(prompt: Prompt, megabytes: float) -> Prompt:
    """A copy of ``prompt`` carrying ``metadata["feature"]``: ``megabytes`` of float32 values drawn from
    the prompt's index (the same feature wherever it is made)."""
    if megabytes <= 0:
        return prompt
    generator = torch.Generator().manual_seed(prompt.index)
    feature = torch.rand(max(1, int(megabytes * 2**20 / 4)), generator=generator)
    return replace(prompt, metadata={**prompt.metadata, "feature": feature})


#: what ``stat`` calls the kinds of file that are not regular files or folders
_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def read_rows(path: str) -> list[tuple[dict, str]]:
    """Rows of a jsonl or parquet file, each with its source (``file:line``)."""
    if not os.path.exists(path):
        raise DataError(f"--data.path {path}: no such file")
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):  # reading a pipe or a device could block forever
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise DataError(f"--data.path {path}: {kind}, not a regular file; give a .jsonl or .parquet file (or a "
                        "folder saved with datasets' save_to_disk)")
    if os.path.isdir(path):
        return _read_dataset_folder(path)
    if path.endswith((".jsonl", ".json")):
        return _read_jsonl(path)
    if path.endswith(".parquet"):
        return _read_parquet(path)
    raise DataError(f"--data.path {path}: unknown format; expected .jsonl or .parquet")


def _read_dataset_folder(path: str) -> list[tuple[dict, str]]:
    """The rows of a folder saved with datasets' ``save_to_disk`` (a ``DatasetDict``'s ``train`` split)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data.path {path}: a dataset folder needs the datasets package: "
                        "pip install datasets") from None
    try:
        dataset = datasets.load_from_disk(path)
    except Exception as err:  # noqa: BLE001  datasets raises many error types; reported as a DataError
        raise DataError(f"--data.path {path}: not a folder saved with datasets' save_to_disk: {err}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(f"--data.path {path}: a DatasetDict without a 'train' split ({', '.join(dataset)})")
        dataset = dataset["train"]
    return [(row, f"{path}:row {i + 1}") for i, row in enumerate(dataset)]


def _read_jsonl(path: str) -> list[tuple[dict, str]]:
    """The JSON objects of a jsonl file, one a line (blank lines skipped); an error names the line."""
    rows = []
    try:
        # undecodable bytes become lone surrogates here, found per line below: an error names the line
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for line_no, line in enumerate(f, start=1):
                _check_utf8(path, line_no, line)
                if line_no == 1:
                    line = line.removeprefix("\ufeff")  # a UTF-8 byte order mark
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{line_no}: malformed JSON line: {err.msg}") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
                rows.append((row, f"{path}:{line_no}"))
    except OSError as err:
        raise DataError(f"--data.path {path}: cannot read: {err}") from None
    return rows


def _read_parquet(path: str) -> list[tuple[dict, str]]:
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001  pyarrow raises many error types; reported as a DataError
        raise DataError(f"--data.path {path}: cannot read parquet: {err}") from None
    return [(row, f"{path}:row {i + 1}") for i, row in enumerate(table.to_pylist())]


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _check_utf8(path: str, line_no: int, line: str) -> None:
    """A ``DataError`` naming the line and column of the first byte of ``line`` that was not UTF-8 (read
    with ``errors="surrogateescape"``, which turns such a byte into a lone surrogate)."""
    bad = None if line.isascii() else _ESCAPED_BYTE.search(line)
    if bad is not None:
        raise DataError(f"{path}:{line_no}: not valid UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x} at character "
                        f"{bad.start() + 1}); save the file as UTF-8")


def embedded_rows(task: str, num_prompts: int, split: Literal["train", "test"], digits: tuple[int, int] = (2, 3),
                  judged_share: tuple[float, float] = (0.1, 0.9)) -> list[tuple[dict, str]]:
    """Rows of an embedded task's split, each with its source (``<task:split>:row``)."""
    if task not in TASKS:
        raise DataError(f"--data.task {task!r}: valid choices: {', '.join(TASKS)}")
    if task == "mixed":
        start, end = judged_share
        if not (0 <= start <= 1 and 0 <= end <= 1):
            raise DataError(f"--data.task_judged_share {list(judged_share)}: both shares must be within [0, 1]")
        options: dict[str, Any] = {"judged_share": (start, end)}
    else:
        options = {}
    try:
        rows = TASKS[task](num_prompts, 0, split, tuple(digits), **options)
    except ValueError as err:
        raise DataError(f"--data.task {task} --data.task_digits {list(digits)}: {err}") from None
    return [(row, f"<{task}:{split}>:{i + 1}") for i, row in enumerate(rows)]


def load_prompts(config: DataConfig, tokenizer, max_new_tokens: int, context: int | None,  # noqa: ANN001
                 processor=None) -> list[Prompt]:  # noqa: ANN001
    """Read, template and tokenize every prompt; reject rows that cannot be used. ``processor``: the model's
    (``gcore.vision.load_processor``), for image prompts."""
    if config.path is None:
        rows = embedded_rows(config.task, config.num_synthetic_prompts, "train", config.task_digits,
                             config.task_judged_share)
    else:
        rows = read_rows(config.path)
    if not rows:
        raise DataError(f"--data.path {config.path or '<embedded>'}: the dataset is empty")
    return tokenize_rows(rows, config, tokenizer, max_new_tokens, context, _metadata_keys(config, config.path is None),
                         processor, _folder(config.path))


def _folder(path: str | None) -> str:
    """The folder that relative image paths of a data file start from."""
    return os.path.dirname(os.path.abspath(path)) if path is not None else os.getcwd()


def check_images(config: DataConfig) -> None:
    """Read every image of ``--data.path`` and ``--data.eval_path`` once, before any controller starts: a missing,
    unreadable, truncated or too large image is a one-line ``DataError`` naming its file and row here, not in
    every controller later."""
    if config.image_key is None:
        return
    for path in (config.path, config.eval_path):
        if path is not None:
            for row, source in read_rows(path):
                _row_images(row, config, source, _folder(path))


def _row_images(row: dict, config: DataConfig, source: str, base_dir: str) -> list:
    """The PIL images of one row (``images_column``): read, checked, and blanked with ``blank_images``."""
    from gcore.vision import read_image

    key = config.images_column
    assert key is not None  # only called for image prompts
    if key not in row or row[key] is None:
        raise DataError(f"{source}: no {key!r} key (keys: {', '.join(map(str, row)) or 'none'}) named in "
                        "--data.image_key")
    values = row[key] if isinstance(row[key], (list, tuple)) else [row[key]]
    if not values:
        raise DataError(f"{source}: {key!r} holds no image")
    images = [read_image(value, base_dir, source, config.max_image_pixels, config.resize_images,
                         config.resize_max_pixels) for value in values]
    if config.blank_images:
        from PIL import Image

        images = [Image.new("RGB", image.size, CANVAS_COLOUR) for image in images]
    return images


def _metadata_keys(config: DataConfig, embedded: bool) -> list[str]:
    """The columns that become prompt metadata: ``metadata_keys``, and the embedded task's own."""
    return list(dict.fromkeys([*(TASK_METADATA.get(config.task, []) if embedded else []), *config.metadata_keys]))


def load_eval_prompts(config: DataConfig, tokenizer, max_new_tokens: int, context: int | None,  # noqa: ANN001
                      processor=None) -> list[Prompt]:  # noqa: ANN001
    """The held-out prompts: ``eval_path``, else the embedded task's test split (first ``num_eval_prompts``)."""
    if config.num_eval_prompts < 1:
        raise DataError(f"--data.num_eval_prompts must be >= 1, got {config.num_eval_prompts}")
    if config.eval_path is not None:
        rows = read_rows(config.eval_path)[: config.num_eval_prompts]
    elif config.path is None:
        rows = embedded_rows(config.task, config.num_eval_prompts, "test", config.task_digits,
                             config.task_judged_share)
    else:
        raise DataError("evaluation needs held-out prompts: set --data.eval_path (a .jsonl or .parquet file "
                        "like --data.path)")
    if not rows:
        raise DataError(f"--data.eval_path {config.eval_path}: the dataset is empty")
    embedded = config.eval_path is None
    return tokenize_rows(rows, config, tokenizer, max_new_tokens, context, _metadata_keys(config, embedded), processor,
                         _folder(config.eval_path))


def tokenize_rows(rows: list[tuple[dict, str]], config: DataConfig, tokenizer, max_new_tokens: int,  # noqa: ANN001
                  context: int | None, metadata_keys: list[str] | None = None, processor=None,  # noqa: ANN001
                  base_dir: str = ".") -> list[Prompt]:
    """Template and tokenize rows (with their sources) as ``Prompt``s, copying the ``metadata_keys`` columns
    (default ``config.metadata_keys``) into their metadata; reject rows that cannot be used. Image prompts
    (``config.has_images``) go through ``processor``, their relative image paths from ``base_dir``."""
    if config.has_images and processor is None:
        raise DataError("image prompts need the model's processor (gcore.vision.load_processor)")
    prompts = []
    metadata_keys = config.metadata_keys if metadata_keys is None else metadata_keys
    for index, (row, source) in enumerate(rows):
        if config.prompt_key not in row:
            raise DataError(
                f"{source}: no {config.prompt_key!r} key (keys: {', '.join(map(str, row)) or 'none'}); "
                "set --data.prompt_key"
            )
        raw = row[config.prompt_key]
        if not isinstance(raw, str) or not raw:
            raise DataError(f"{source}: {config.prompt_key!r} must be a non-empty string")
        try:
            text = content = config.prompt_template.format(prompt=raw)
        except (KeyError, IndexError, ValueError) as err:
            raise DataError(f"--data.prompt_template {config.prompt_template!r}: {err}") from None
        visual: VisualInputs | None = None
        if config.has_images:
            from gcore.vision import encode

            token_ids, visual = encode(processor, text, _row_images(row, config, source, base_dir), source)
        elif config.chat_template:
            check_tokenizer(config, tokenizer)
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
            token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            token_ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if not token_ids:
            raise DataError(f"{source}: the prompt tokenizes to nothing")
        if context is not None and len(token_ids) + max_new_tokens > context:
            raise DataError(
                f"{source}: prompt of {len(token_ids)} tokens + {max_new_tokens} new tokens exceeds the "
                f"model's context of {context} tokens"
            )
        missing = next((key for key in metadata_keys if key not in row), None)
        if missing is not None:
            raise DataError(f"{source}: no {missing!r} key (keys: {', '.join(map(str, row)) or 'none'}) named in "
                            "--data.metadata_keys")
        answer = row.get(config.answer_key)
        metadata = {key: row[key] for key in metadata_keys}
        column = config.images_column
        images = row.get(column) if column else None
        references = [images] if isinstance(images, str) else images if isinstance(images, list) else []
        if references and all(isinstance(i, str) and len(i) <= 4096 and os.path.isfile(os.path.join(base_dir, i))
                              for i in references):
            metadata[str(column)] = images  # the image paths (not base64), for a reward that reads them
        prompts.append(Prompt(index, text, token_ids, None if answer is None else str(answer), source,
                              metadata, content, visual))
    return prompts


class PromptSampler:
    """Each step's prompts for one rank: an epoch-wise shuffled order, dealt out over the ranks.

    Every prompt is used once per epoch; the step's global batch is split so that each prompt goes
    to exactly one rank: by predicted cost when a ``balancer`` is given (the same split on every
    rank), else round robin. ``state_dict`` holds the position (and the learnt lengths) so a
    resumed run continues where it was.
    """

    def __init__(self, num_prompts: int, per_step: int, rank: int, world_size: int, seed: int, shuffle: bool,
                 balancer: CostBalancer | None = None) -> None:
        if per_step < world_size:
            raise DataError(f"--data.prompts_per_step {per_step} is smaller than the {world_size} controllers")
        self.num_prompts, self.per_step = num_prompts, per_step
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.balancer = balancer
        self.last_imbalance = 1.0  # predicted max/mean cost over ranks of the last shard
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def next_global(self) -> list[int]:
        """The whole step's prompt indices (the same on every rank)."""
        chosen: list[int] = []
        while len(chosen) < self.per_step:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.per_step - len(chosen), len(self._order) - self.position)
            chosen.extend(self._order[self.position : self.position + take])
            self.position += take
        return chosen

    def peek_global(self) -> list[int]:
        """What ``next_global`` will return, without drawing it."""
        epoch, position, order = self.epoch, self.position, self._order
        try:
            return self.next_global()
        finally:
            self.epoch, self.position, self._order = epoch, position, order

    def shard(self, indices: list[int]) -> list[int]:
        """This rank's part of a step's indices."""
        if self.balancer is None or self.world_size == 1:
            parts = round_robin(len(indices), self.world_size)
            costs = [1.0] * len(indices)
        else:
            costs = [self.balancer.cost(i) for i in indices]
            parts = karmarkar_karp(costs, self.world_size)
        self.last_imbalance = imbalance(costs, parts)
        return [indices[j] for j in parts[self.rank]]

    def state_dict(self) -> dict:
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts}
        if self.balancer is not None:
            state["lengths"] = self.balancer.predictor.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("num_prompts", self.num_prompts)
        if saved != self.num_prompts:
            raise DataError(f"--trainer.resume: the checkpoint's prompt stream is over {saved} prompts, this run "
                            f"has {self.num_prompts}: resume with the same --data.path (and "
                            "--data.num_synthetic_prompts)")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)
        if self.balancer is not None and "lengths" in state:
            self.balancer.predictor.load_state_dict(state["lengths"])


class CostBalancer:
    """Predicted cost of a prompt's group: ``n * (prompt tokens + expected response tokens)``."""

    def __init__(self, prompts: list[Prompt], n: int, max_new_tokens: int) -> None:
        self.prompt_lengths = [len(p.token_ids) for p in prompts]
        self.n = n
        self.predictor = LengthPredictor(default=max_new_tokens / 2)

    def cost(self, index: int) -> float:
        length = self.prompt_lengths[index]
        return self.n * (length + self.predictor.expected(index, length))

    def observe(self, index: int, mean_response_length: float) -> None:
        self.predictor.observe(index, self.prompt_lengths[index], mean_response_length)

    def learn(self, samples: list[Sample], per_step: int,
              all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Learn the response lengths of a step's ``samples`` (at most ``per_step`` prompts); with
        ``all_gather`` (several controllers), every rank learns every rank's rows, so that all
        predict alike: one all-gather of (prompt, mean length) rows."""
        by_prompt: dict[int, list[int]] = {}
        for sample in samples:
            by_prompt.setdefault(sample.prompt.index, []).append(len(sample.response_ids))
        rows = torch.full((per_step, 2), -1.0, dtype=torch.float64)
        for row, (index, lengths) in enumerate(sorted(by_prompt.items())[:per_step]):
            rows[row, 0], rows[row, 1] = index, sum(lengths) / len(lengths)
        gathered = all_gather(rows).reshape(-1, 2) if all_gather is not None else rows
        for index, length in gathered.tolist():
            if index >= 0:
                self.observe(int(index), length)
