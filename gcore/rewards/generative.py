"""``generative`` reward: an LLM judge (GenRM) on an ``Engine`` of its own."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import torch

from gcore.engines.base import Engine
from gcore.errors import ConfigError, RewardError
from gcore.model import ModelSource
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
VERDICTS = ("probability", "yes_no", "score")
#: the spellings whose first tokens count as a yes (or a no) in the ``probability`` verdict
YES_SPELLINGS = ("yes", " yes", "Yes", " Yes")
NO_SPELLINGS = ("no", " no", "No", " No")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_verdict(text: str, verdict: Literal["yes_no", "score"], max_score: float) -> float | None:
    """The judge's reward in [0, 1] from its text, or None when it cannot be parsed."""
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
        path: local checkpoint directory of the judge (with its tokenizer).
        engine: the engine that runs the judge (``hf`` on CPU).
        template: the judge prompt; ``{prompt}``, ``{response}`` and ``{answer}`` are filled in.
        verdict: ``probability`` (the reward is P(yes) / (P(yes) + P(no)) of the judge's next token after
            the prompt, summed over the first tokens of ``yes``/``Yes`` with and without a leading space, and
            likewise for no: never unparsable; needs an engine with ``next_token_logprobs``, such as ``hf``),
            ``yes_no`` (generated text: yes -> 1, no -> 0) or ``score`` (generated text: a number in
            ``[0, max_score]``, scaled to [0, 1]).
        chat_template: when the judge's tokenizer has a chat template, send the filled ``template`` as one user
            message with the generation prompt added (the verdict is read right after it); ``false`` sends the
            filled template as it is.
        max_score: the top of the judge's score scale.
        max_new_tokens: the judge's generation budget (``yes_no`` and ``score``).
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
        verdict: Literal["probability", "yes_no", "score"] = "probability",
        chat_template: bool = True,
        max_score: float = 10.0,
        max_new_tokens: int = 8,
        batch_size: int = 16,
        unparsable_score: float | None = 0.0,
        retries: int = 1,
        timeout_s: float = 0.0,
        trust_remote_code: bool = False,
        images: bool = True,
    ) -> None:
        if verdict not in VERDICTS:
            raise ConfigError(f"--reward.verdict {verdict!r}: valid choices: {', '.join(VERDICTS)}")
        if "{response}" not in template:
            raise ConfigError("--reward.template must contain {response}")
        if batch_size <= 0 or max_new_tokens <= 0 or retries < 0:
            raise ConfigError("--reward.batch_size and max_new_tokens must be positive, retries >= 0")
        from gcore.engines.hf import HFEngine

        self.path, self.engine = path, engine or HFEngine()
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

    def _check_engine(self, engine: Engine) -> None:
        if self.verdict == "probability" and not _gives_logprobs(engine):
            raise ConfigError(f"--reward.verdict probability needs an engine with next-token log-probabilities, "
                              f"which the {type(engine).__name__} engine does not give: use the hf engine or "
                              f"another verdict; valid choices: {', '.join(VERDICTS)}")

    @property
    def source(self) -> ModelSource:
        """The judge checkpoint (loaded in float32)."""
        return ModelSource(self.path, torch.float32, self.trust_remote_code)

    def setup(self, device) -> None:  # noqa: ANN001
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        if self.verdict == "probability":
            self.yes_ids, self.no_ids = verdict_token_ids(self.tokenizer)
        self.processor, self._stand_in = None, None
        if self.images and self.chat_template:
            from gcore.model import image_text_to_text

            if image_text_to_text(self.path, self.trust_remote_code):
                from gcore.vision import load_processor

                self.processor = load_processor(self.path, self.trust_remote_code)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.engine.setup(self.source, device)

    def judges(self) -> list[Judge]:
        """This reward's judge: a placement policy may run it on engine workers of its own."""
        return [Judge(self.engine, self.source, self._use_engine)]

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
                                    answer=sample.prompt.answer or "")

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

    def _judge(self, prompts: list[list[int]], visual: list[VisualInputs | None]) -> list[str]:
        """The judge's generated verdicts (``yes_no``, ``score``), with the images where there are any."""
        if any(v is not None for v in visual):
            self._check_images()

            def call() -> list[Any]:
                return self.engine.generate(prompts, self.params, visual=visual)
        else:
            def call() -> list[Any]:
                return self.engine.generate(prompts, self.params)
        outs = self._call("verdicts", call, len(prompts))
        self.last_judge_tokens += sum(len(o[0].token_ids) for o in outs)
        return [self.tokenizer.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]

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
        self.last_error = None
        scores: list[float] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            inputs = [self.judge_inputs(s) for s in chunk]
            prompts, visual = [ids for ids, _ in inputs], [v for _, v in inputs]
            if self.verdict == "probability":
                scores.extend(self._probabilities(prompts, visual))
                continue
            for sample, text in zip(chunk, self._judge(prompts, visual), strict=False):
                value = parse_verdict(text, self.verdict, self.max_score)
                if value is None:
                    self.last_unparsable += 1
                    if self.unparsable_score is None:
                        raise RewardError(
                            f"unparsable judge verdict {text!r} for prompt "
                            f"{sample.prompt.source or sample.prompt.index}; "
                            "set --reward.unparsable_score to score such samples and go on"
                        )
                    if self.last_error is None:  # no log line per sample: reward/errors counts them
                        where, score = sample.prompt.source or sample.prompt.index, self.unparsable_score
                        self.last_error = f"unparsable judge verdict {text!r} for prompt {where}, scored {score}"
                    value = self.unparsable_score
                    sample.reward_info["judge_unparsable"] = 1.0
                scores.append(float(value))
        self.last_errors = self.last_unparsable
        return scores
