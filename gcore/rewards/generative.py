"""``generative`` reward: an LLM judge (GenRM) on an ``Engine`` of its own."""

from __future__ import annotations

import atexit
import logging
import re
import shutil
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import torch

from gcore.engines.base import Engine
from gcore.errors import ConfigError, RewardError
from gcore.model import ModelSource, converted_gguf, is_gguf
from gcore.rewards.base import Judge, RewardModel
from gcore.types import Sample, SamplingParams, VisualInputs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: the judge prompt (the user message when the judge has a chat template). Of 8 wordings measured with
#: SmolLM2-135M-Instruct on the compare task (benchmarks/judge_agreement.py, BENCHMARKS.md) this one ranked right
#: answers above wrong ones best (AUC 0.65 on 12 prompts), which is still close to chance: a 135M judge cannot
#: tell a right final answer from a wrong one.
DEFAULT_TEMPLATE = (
    "You are a strict grader. The correct answer is {answer}.\n\nReply to grade: {response}\n\n"
    "Is the reply correct? Answer with one word: yes or no."
)
#: the built-in judge prompts that ask for a short critique first and then a verdict line, which the judge's
#: text is read at (the last one: ``VERDICT_LINE``), per ``--reward.verdict``
REASONING_TEMPLATES = {
    "yes_no": (
        "You are a strict grader. The correct answer is {answer}.\n\nReply to grade: {response}\n\n"
        "In one or two short sentences, say whether the reply's final answer is the correct answer. "
        "Then end with a last line that is exactly 'Verdict: yes' if it is, or 'Verdict: no' if it is not."
    ),
    "score": (
        "You are a strict grader. The correct answer is {answer}.\n\nReply to grade: {response}\n\n"
        "In one or two short sentences, say how well the reply answers: is its final answer the correct answer? "
        "Then end with a last line 'Verdict: N/{max_score}', where N is a whole number from 0 (wrong) to "
        "{max_score} (correct)."
    ),
}
#: ``--reward.template``'s built-in names (any other value is a template of its own, with ``{response}``)
TEMPLATES = ("default", "reasoning")
VERDICTS = ("probability", "yes_no", "score")
#: where a reasoning judge's verdict is read: the text after ``Verdict:`` (any case, markdown ``**`` around
#: it allowed) to the end of its line; the last such line in the reply counts
VERDICT_LINE = r"(?i)\bverdict\b[^\w\n]{0,4}?:[^\w\n]*(\w[^\n]*)"
#: the judge's generation budget: one word, or a critique and a verdict line
ONE_WORD_TOKENS, REASONING_TOKENS = 8, 128
#: the spellings whose first tokens count as a yes (or a no) in the ``probability`` verdict
YES_SPELLINGS = ("yes", " yes", "Yes", " Yes")
NO_SPELLINGS = ("no", " no", "No", " No")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_DENOMINATOR = re.compile(r"/\s*\d+(?:\.\d+)?")


def parse_verdict(text: str, verdict: Literal["yes_no", "score"], max_score: float,
                  pattern: re.Pattern[str] | None = None) -> float | None:
    """The judge's reward in [0, 1] from its text, or None when it cannot be parsed.

    Without ``pattern``: the first yes or no (``yes_no``) or the first number (``score``) in the text. With one
    (a reasoning judge's verdict line): only the pattern's last match counts, its first group (or the whole match
    where it has none) read as above; no match is unparsable. So a critique's own yes and no and its numbers are
    not the verdict, and nor is a verdict the critique quotes before its final one; nor is a scale's denominator
    (``/10``) a score.
    """
    if pattern is not None:
        matches = list(pattern.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        text = last.group(1) if pattern.groups else last.group(0)
        if text is None:  # an optional group that did not take part
            return None
        # a scale's denominator is not the score: "7/10" reads 7, a template's "N/10" echoed back reads nothing
        text = _DENOMINATOR.sub("", text)
    if verdict == "yes_no":
        hit = _YES_NO.search(text)
        return None if hit is None else float(hit.group(1).lower() == "yes")
    hit = _NUMBER.search(text)
    if hit is None:
        return None
    value = float(hit.group(0))
    return value / max_score if 0 <= value <= max_score else None


def verdict_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The distinct first token ids of ``YES_SPELLINGS`` and of ``NO_SPELLINGS``; an id both start (a
    character tokenizer's leading space) counts for neither."""
    def first_ids(spellings: Sequence[str]) -> list[int]:
        ids = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in spellings)
        return list(dict.fromkeys(i[0] for i in ids if i))

    yes, no = first_ids(YES_SPELLINGS), first_ids(NO_SPELLINGS)
    yes, no = [i for i in yes if i not in no], [i for i in no if i not in yes]
    if not yes or not no:
        raise ConfigError("--reward.verdict probability: the judge's tokenizer gives no distinct first token "
                          "for yes and no; valid choices: " + ", ".join(VERDICTS))
    return yes, no


def _gives_logprobs(engine: Engine) -> bool:
    """Whether ``engine``'s class implements ``next_token_logprobs`` (the base one raises)."""
    return type(engine).next_token_logprobs is not Engine.next_token_logprobs


def _takes_images(engine: Engine) -> bool:
    """Whether ``engine`` judges image prompts: its capabilities say ``images`` (hf; vllm's ``generate`` too, for the
    ``yes_no`` and ``score`` verdicts: ``probability`` needs next-token log-probabilities, which only hf gives)."""
    return engine.capabilities.images


class GenerativeReward(RewardModel):
    """Asks a judge LLM about each sample and turns its verdict into a reward.

    Args:
        path: local checkpoint directory of the judge (with its tokenizer), or a ``.gguf`` file: converted once
            per run into an HF checkpoint folder in the run directory (``converted-judge/``, removed when the run
            ends), which every controller and engine worker loads (``gcore import`` converts it for good).
        engine: the engine that runs the judge (``hf`` on CPU).
        template: the judge prompt; ``{prompt}``, ``{response}``, ``{answer}`` (and ``{max_score}``) are filled
            in. Or a built-in one by name: ``default`` (one word: yes or no) or ``reasoning`` (a short critique,
            then a last line ``Verdict: yes`` / ``Verdict: no``, or ``Verdict: N/max_score`` with
            ``verdict score``; the verdict is read from the last such line: ``verdict_pattern``).
        verdict: ``probability`` (the reward is P(yes) / (P(yes) + P(no)) of the judge's next token after
            the prompt, summed over the first tokens of ``yes``/``Yes`` with and without a leading space, and
            likewise for no: never unparsable; needs an engine with ``next_token_logprobs``, such as ``hf``),
            ``yes_no`` (generated text: yes -> 1, no -> 0) or ``score`` (generated text: a number in
            ``[0, max_score]``, scaled to [0, 1]). ``auto``: ``yes_no`` where a verdict line is read (template
            ``reasoning`` or a ``verdict_pattern``), else ``probability``.
        verdict_pattern: a regular expression (Python ``re``) for the verdict in the judge's generated text: its
            LAST match is read (its group, where it has one, else the whole match) as ``verdict`` says; no match
            is an unparsable verdict. Unset: the built-in ``Verdict:`` line with template ``reasoning``
            (``VERDICT_LINE``), else the whole text (the first yes/no or number in it).
        chat_template: when the judge's tokenizer has a chat template, send the filled ``template`` as one user
            message with the generation prompt added (the verdict is read right after it); ``false`` sends the
            filled template as it is.
        max_score: the top of the judge's score scale.
        max_new_tokens: the judge's generation budget (``yes_no`` and ``score``). 0: 128 where a verdict line is
            read after a critique (template ``reasoning`` or a ``verdict_pattern``), else 8. A critique cut at
            this budget before its verdict line is an unparsable verdict.
        batch_size: samples per judge call.
        unparsable_score: the reward of a sample whose verdict cannot be parsed (counted in
            ``reward/errors``; the controller warns once per step with the first such verdict);
            ``None`` fails the step instead.
        retries: attempts again on a judge call that raises before the step fails.
        timeout_s: a judge call slower than this counts as failed (checked after it returns).
        images: when the judge is an image-text-to-text checkpoint and a sample's prompt has images, the judge
            sees them: its prompt is the images then the filled template in one user message, through the
            judge's processor and chat template (docs/multimodal.md, "Rewards"). The images reach the judge as
            the prompt's processed tensors (``Prompt.visual``), so the judge must process images as the policy
            does (its processor must give tensors of the same shapes; refused in one line otherwise).
            ``false``, a text-only judge, or ``chat_template false``: the judge reads the text only.
    """

    def __init__(
        self,
        path: str,
        engine: Engine | None = None,
        template: str = DEFAULT_TEMPLATE,
        verdict: Literal["auto", "probability", "yes_no", "score"] = "auto",
        verdict_pattern: str | None = None,
        chat_template: bool = True,
        max_score: float = 10.0,
        max_new_tokens: int = 0,
        batch_size: int = 16,
        unparsable_score: float | None = 0.0,
        retries: int = 1,
        timeout_s: float = 0.0,
        trust_remote_code: bool = False,
        images: bool = True,
    ) -> None:
        reasoning = template == "reasoning"
        if verdict == "auto":
            verdict = "yes_no" if reasoning or verdict_pattern is not None else "probability"
        if verdict not in VERDICTS:
            raise ConfigError(f"--reward.verdict {verdict!r}: valid choices: auto, {', '.join(VERDICTS)}")
        self.pattern = _verdict_pattern(verdict_pattern, reasoning, verdict)
        template = _template(template, verdict)
        if max_new_tokens == 0:
            max_new_tokens = REASONING_TOKENS if self.pattern is not None else ONE_WORD_TOKENS
        if batch_size <= 0 or max_new_tokens <= 0 or retries < 0:
            raise ConfigError("--reward.batch_size and max_new_tokens must be positive, retries >= 0")
        from gcore.engines.hf import HFEngine

        self.path, self.engine = path, engine or HFEngine()
        #: the judge's HF checkpoint folder where ``path`` is a ``.gguf`` file, once converted (``prepare``)
        self.checkpoint: str | None = None
        #: the engine as configured: it runs the judge here, or copies of it run it in engine workers
        #: (``_use_engine``), so it says what the judge can take (``_check_images``)
        self.configured: Engine = self.engine
        self.template, self.verdict, self.max_score = template, verdict, max_score
        self.chat_template = chat_template
        self._check_engine(self.engine)
        self.params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
        self.batch_size, self.unparsable_score = batch_size, unparsable_score
        self.retries, self.timeout_s, self.trust_remote_code = retries, timeout_s, trust_remote_code
        self.images = images
        self.tokenizer: Any = None  # a transformers tokenizer once set up
        self.processor: Any = None  # the judge's processor, for an image-text-to-text judge (``images``)
        self._stand_in: VisualInputs | None = None  # its inputs for one 56-pixel image: the keys and patch width
        self.yes_ids: list[int] = []
        self.no_ids: list[int] = []
        self.last_unparsable = 0
        self.last_judge_tokens = 0
        #: the judge's generated replies in the last ``score``, in the samples' order (each sample's reply length
        #: in tokens is its ``reward_info["judge_tokens"]``); none for the ``probability`` verdict
        self.last_replies: list[str] = []

    def _check_engine(self, engine: Engine) -> None:
        if self.verdict == "probability" and not _gives_logprobs(engine):
            raise ConfigError(f"--reward.verdict probability needs an engine with next-token log-probabilities, "
                              f"which the {type(engine).__name__} engine does not give: use the hf engine or "
                              f"another verdict; valid choices: {', '.join(VERDICTS)}")

    @property
    def source(self) -> ModelSource:
        """The judge checkpoint (loaded in float32): ``path``, or its conversion where it is a ``.gguf`` file
        (made here, in a folder of this process's own, where no ``prepare`` made it for the run)."""
        if is_gguf(self.path) and self.checkpoint is None:
            self.prepare(_own_folder())
        return ModelSource(self.checkpoint or self.path, torch.float32, self.trust_remote_code)

    def prepare(self, folder: str) -> None:
        """Where ``path`` is a ``.gguf`` file, convert it into an HF checkpoint under ``folder`` unless a process
        of the run did (``converted_gguf``); the judge is loaded from there. Called once per process before the
        judge's engines start (``Judge.prepare``: the trainer, with the run directory's ``converted-judge``)."""
        if not is_gguf(self.path) or self.checkpoint is not None:
            return
        self.checkpoint = converted_gguf(
            self.path, folder, torch.float32, "--reward.path",
            announce=f"converting the judge {self.path} to an HF checkpoint in {folder} for this run "
                     "(`gcore import` converts it once for later runs)")

    def setup(self, device) -> None:  # noqa: ANN001
        from transformers import AutoTokenizer

        source = self.source
        self.tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=self.trust_remote_code)
        if self.verdict == "probability":
            self.yes_ids, self.no_ids = verdict_token_ids(self.tokenizer)
        elif self.tokenizer.eos_token_id is not None:  # a critique ends at the tokenizer's end of turn
            stops = tuple(dict.fromkeys((*self.params.stop_token_ids, self.tokenizer.eos_token_id)))
            self.params = SamplingParams(n=1, max_new_tokens=self.params.max_new_tokens, temperature=0.0,
                                         stop_token_ids=stops)
        self.processor, self._stand_in = None, None
        if self.images and self.chat_template:
            from gcore.model import image_text_to_text

            if image_text_to_text(source.path, self.trust_remote_code):
                from gcore.vision import load_processor

                self.processor = load_processor(source.path, self.trust_remote_code)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.engine.setup(source, device)

    def judges(self) -> list[Judge]:
        """This reward's judge: a placement policy may run it on engine workers of its own. Its ``source`` is
        the converted folder once ``prepare`` ran (the trainer runs it first), else ``path`` as given."""
        source = ModelSource(self.checkpoint or self.path, torch.float32, self.trust_remote_code)
        return [Judge(self.engine, source, self._use_engine, self.prepare)]

    def _use_engine(self, engine: Engine) -> None:
        self._check_engine(engine)
        self.engine = engine

    def judge_prompt(self, sample: Sample) -> str:
        """The text the judge reads: the filled template, in the judge's chat template when it has one
        (and ``chat_template``). Without the images a VLM judge sees (``judge_inputs``)."""
        text = self._filled(sample)
        if self.chat_template and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return text

    def _filled(self, sample: Sample) -> str:
        return self.template.format(prompt=sample.prompt.text, response=sample.response_text,
                                    answer=sample.prompt.answer or "", max_score=f"{self.max_score:g}")

    def judge_inputs(self, sample: Sample) -> tuple[list[int], VisualInputs | None]:
        """The judge's prompt token ids and the images it sees with them: for an image-text-to-text judge and a
        sample whose prompt has images, one user message of the images then the filled template through the
        judge's processor and chat template, with the prompt's visual inputs; else ``judge_prompt``'s tokens."""
        visual = sample.prompt.visual
        if self.processor is None or visual is None:
            return self._encode(self.judge_prompt(sample)), None
        from PIL import Image

        from gcore.vision import encode

        where = sample.prompt.source or str(sample.prompt.index)
        grid = visual.tensors.get("image_grid_thw")
        if grid is None:  # e.g. Llava style, pixel_values [images, channels, height, width]: the processed sizes
            pixels = visual.tensors.get("pixel_values")
            if pixels is None or pixels.dim() != 4:
                self._refuse(where, "its visual inputs give no image sizes", visual)
            stand_ins = [Image.new("RGB", (int(pixels.shape[3]), int(pixels.shape[2])))] * int(pixels.shape[0])
            token_ids, own = encode(self.processor, self._filled(sample), stand_ins, where)
        else:  # Qwen2-VL style: each image is prod(grid) / merge_size**2 placeholder tokens, as its processor places
            merge = getattr(getattr(self.processor, "image_processor", None), "merge_size", None)
            token = getattr(self.processor, "image_token", None)
            if merge is None or token is None:
                self._refuse(where, "its processor places images otherwise (no merge_size or image_token)", visual)
            if self._stand_in is None:  # the judge's processor on one stand-in image, once: the keys and patch width
                self._stand_in = encode(self.processor, "", [Image.new("RGB", (56, 56))], where)[1]
            own = self._stand_in
            message = [{"role": "user", "content": [*({"type": "image"} for _ in range(len(grid))),
                                                    {"type": "text", "text": self._filled(sample)}]}]
            templated = self.processor.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
            counts = iter([int(g.prod()) // int(merge) ** 2 for g in grid])
            pieces = templated.split(token)
            if len(pieces) != len(grid) + 1:
                self._refuse(where, f"its chat template gave {len(pieces) - 1} image placeholders", visual)
            expanded = pieces[0] + "".join(token * next(counts) + piece for piece in pieces[1:])
            tokenizer = getattr(self.processor, "tokenizer", self.tokenizer)
            token_ids = list(tokenizer(expanded, add_special_tokens=False)["input_ids"])
        mine = {k: tuple(v.shape[1:]) for k, v in own.tensors.items()}
        theirs = {k: tuple(v.shape[1:]) for k, v in visual.tensors.items()}
        if mine != theirs:
            self._refuse(where, f"judge tensors {mine}, the prompt's {theirs} (per image or patch)", visual)
        return token_ids, visual

    def _refuse(self, where: str, why: str, visual: VisualInputs) -> NoReturn:
        raise ConfigError(f"--reward.path {self.path}: the judge processes images otherwise than the policy ({where}: "
                          f"{why}; the prompt has {', '.join(visual.tensors)}); a VLM judge sees the prompt's "
                          "processed images, so use a judge with the policy's image processor, or "
                          "--reward.images false to judge the text only")

    def _encode(self, text: str) -> list[int]:
        # a chat template writes its own special tokens; a plain prompt gets the tokenizer's usual ones
        templated = self.chat_template and getattr(self.tokenizer, "chat_template", None)
        return list(self.tokenizer(text, add_special_tokens=not templated)["input_ids"])

    def _call(self, what: str, call: Callable[[], list[Any]], count: int) -> list[Any]:
        """One judge call with retries; raises ``RewardError`` when every attempt failed."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            started = time.perf_counter()
            try:
                outs = call()
            except NotImplementedError as err:  # e.g. a pool worker's engine without next-token log-probabilities
                raise ConfigError(f"--reward.verdict {self.verdict}: {err}; valid choices: "
                                  f"{', '.join(VERDICTS)}") from err
            except Exception as err:  # noqa: BLE001  the judge engine may fail in any way; retry then report
                last = err
                log.warning("judge call failed (attempt %d/%d): %s", attempt + 1, self.retries + 1, err)
                continue
            elapsed = time.perf_counter() - started
            if self.timeout_s and elapsed > self.timeout_s:
                last = TimeoutError(f"judge call took {elapsed:.1f}s > timeout_s {self.timeout_s}s")
                log.warning("judge call timed out (attempt %d/%d)", attempt + 1, self.retries + 1)
                continue
            if len(outs) != count:
                raise RewardError(f"judge engine returned {len(outs)} {what} for {count} samples")
            return outs
        raise RewardError(
            f"the generative judge failed {self.retries + 1} times on a batch of {count} samples: "
            f"{type(last).__name__}: {last}; no reward was given to them"
        )

    def _check_images(self) -> None:
        """One line where the judge's engine cannot take the prompts' images for this verdict: checked on the
        configured engine, since a pool engine only forwards them to copies of it in the engine workers."""
        if not _takes_images(self.configured):
            engines = "hf" if self.verdict == "probability" else "hf or vllm"
            raise ConfigError(f"--reward.images: the {type(self.configured).__name__} judge engine takes no images "
                              f"for --reward.verdict {self.verdict}; use --reward.engine {engines}, or "
                              "--reward.images false")

    def _judge(self, prompts: list[list[int]], visual: list[VisualInputs | None]) -> list[tuple[str, int, bool]]:
        """The judge's generated verdicts (``yes_no``, ``score``), with the images where there are any: each
        reply's text, its length in tokens, and whether it was cut at ``max_new_tokens``."""
        if any(v is not None for v in visual):
            self._check_images()

            def call() -> list[Any]:
                return self.engine.generate(prompts, self.params, visual=visual)
        else:
            def call() -> list[Any]:
                return self.engine.generate(prompts, self.params)
        outs = self._call("verdicts", call, len(prompts))
        self.last_judge_tokens += sum(len(o[0].token_ids) for o in outs)
        return [(self.tokenizer.decode(o[0].token_ids, skip_special_tokens=True), len(o[0].token_ids),
                 not o[0].finished) for o in outs]

    def _probabilities(self, prompts: list[list[int]], visual: list[VisualInputs | None]) -> list[float]:
        """P(yes) / (P(yes) + P(no)) of each prompt's next token (``probability``), with the images where there
        are any."""
        candidates = self.yes_ids + self.no_ids
        if any(v is not None for v in visual):
            self._check_images()

            def call() -> list[Any]:  # in this process's hf engine, or its copies in engine workers (PoolEngine)
                return self.engine.next_token_logprobs(prompts, candidates, visual=visual)
        else:
            def call() -> list[Any]:
                return self.engine.next_token_logprobs(prompts, candidates)
        rows = self._call("log-probability rows", call, len(prompts))
        logp = torch.tensor(rows, dtype=torch.float64).reshape(len(prompts), len(candidates))
        yes = torch.logsumexp(logp[:, : len(self.yes_ids)], dim=-1)
        no = torch.logsumexp(logp[:, len(self.yes_ids) :], dim=-1)
        return torch.sigmoid(yes - no).tolist()  # P(yes) / (P(yes) + P(no)), without leaving log space

    def score(self, samples: Sequence[Sample]) -> list[float]:
        if self.tokenizer is None:
            self.setup(None)
        self.last_errors = self.last_unparsable = self.last_judge_tokens = 0
        self.last_replies = []
        self.last_error = None
        scores: list[float] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            inputs = [self.judge_inputs(s) for s in chunk]
            prompts, visual = [ids for ids, _ in inputs], [v for _, v in inputs]
            if self.verdict == "probability":
                scores.extend(self._probabilities(prompts, visual))
                continue
            for sample, (text, tokens, cut) in zip(chunk, self._judge(prompts, visual), strict=False):
                self.last_replies.append(text)
                sample.reward_info["judge_tokens"] = float(tokens)
                value = parse_verdict(text, self.verdict, self.max_score, self.pattern)
                if value is None:
                    self.last_unparsable += 1
                    why = f"unparsable judge verdict {text!r}"
                    if self.pattern is not None:
                        why += (f" (no verdict line; cut at --reward.max_new_tokens {self.params.max_new_tokens})"
                                if cut else " (no verdict line: --reward.verdict_pattern)")
                    if self.unparsable_score is None:
                        raise RewardError(
                            f"{why} for prompt {sample.prompt.source or sample.prompt.index}; "
                            "set --reward.unparsable_score to score such samples and go on"
                        )
                    if self.last_error is None:  # no log line per sample: reward/errors counts them
                        where, score = sample.prompt.source or sample.prompt.index, self.unparsable_score
                        self.last_error = f"{why} for prompt {where}, scored {score}"
                    value = self.unparsable_score
                    sample.reward_info["judge_unparsable"] = 1.0
                scores.append(float(value))
        self.last_errors = self.last_unparsable
        return scores


def _template(template: str, verdict: str) -> str:
    """``--reward.template``: a built-in one by name (``TEMPLATES``), or the user's own, with ``{response}``."""
    if template == "default":
        return DEFAULT_TEMPLATE
    if template == "reasoning":
        if verdict not in REASONING_TEMPLATES:
            raise ConfigError(f"--reward.template reasoning reads a verdict line after a critique: it needs a "
                              f"generated verdict, not --reward.verdict {verdict}; valid choices: "
                              f"{', '.join(REASONING_TEMPLATES)}")
        return REASONING_TEMPLATES[verdict]
    if "{response}" not in template:
        shown = template if len(template) <= 40 else template[:37] + "..."
        raise ConfigError(f"--reward.template {shown!r}: neither a built-in template (valid choices: "
                          f"{', '.join(TEMPLATES)}) nor a template with {{response}} in it")
    return template


def _verdict_pattern(pattern: str | None, reasoning: bool, verdict: str) -> re.Pattern[str] | None:
    """``--reward.verdict_pattern`` compiled (``VERDICT_LINE`` for the ``reasoning`` template where unset)."""
    if pattern is None:
        return re.compile(VERDICT_LINE) if reasoning else None
    if verdict == "probability":
        raise ConfigError("--reward.verdict_pattern reads the judge's generated text: it needs --reward.verdict "
                          "yes_no or score, not probability (which reads the next token's probabilities)")
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"--reward.verdict_pattern {pattern!r}: not a regular expression ({err})") from None
    if compiled.groups > 1:
        raise ConfigError(f"--reward.verdict_pattern {pattern!r}: {compiled.groups} groups; it may have at most one "
                          "(the verdict), or none (the whole match is the verdict); use (?:...) for the others")
    if compiled.search("") is not None:
        raise ConfigError(f"--reward.verdict_pattern {pattern!r} matches empty text, so every reply would have a "
                          "verdict; make it require the verdict's words")
    return compiled


_folder: list[str] = []  # this process's folder for judges converted outside a run (``_own_folder``)


def _own_folder() -> str:
    """A temp folder of this process's own for ``.gguf`` judges converted outside a run (a judge used as a library,
    ``gcore eval``), removed when the process exits (and by a later process if this one is killed)."""
    if not _folder:
        from gcore.model import make_workdir

        _folder.append(make_workdir())
        atexit.register(shutil.rmtree, _folder[0], ignore_errors=True)
    return _folder[0]
