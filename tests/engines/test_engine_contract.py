"""The engine contract (gcore/engines/base.py): ``generate`` and ``next_token_logprobs`` declare what they take,
images included, and each engine declares what it supports in one place (``Engine.capabilities``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
import torch

from gcore.engines.base import Engine, EngineCapabilities, Visual, generate_prompts
from gcore.engines.hf import HFEngine
from gcore.engines.pool import PoolEngine
from gcore.engines.sglang import SGLangEngine
from gcore.errors import ConfigError
from gcore.model import ModelSource
from gcore.single_controller import RemoteEngines
from gcore.types import Generation, Prompt, SamplingParams, VisualInputs

IMAGE = VisualInputs({"pixel_values": torch.zeros(1, 3, 28, 28)})
PARAMS = SamplingParams(n=2, max_new_tokens=1)


class TextEngine(Engine):
    """An engine written for token ids alone, as a plugin would be: it declares no capabilities."""

    def __init__(self) -> None:
        self.calls = 0

    def setup(self, source: ModelSource, device: torch.device) -> None:
        pass

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 visual: Visual | None = None) -> list[list[Generation]]:
        self.refuse_images(visual)
        self.calls += 1
        return [[Generation([7], [-0.5], True) for _ in range(params.n)] for _ in prompts]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        return 0


def never_set_up_sglang() -> SGLangEngine:
    return SGLangEngine.__new__(SGLangEngine)  # never set up: the refusal comes before SGLang is reached


@pytest.mark.parametrize("make", [TextEngine, never_set_up_sglang, lambda: RemoteEngines(TextEngine(), 1)],
                         ids=["plugin", "sglang", "one_controller"])
def test_an_engine_without_image_support_refuses_images_in_one_line(make):
    """Images handed to an engine whose capabilities do not say ``images`` are refused in one line that names the
    engine, before it generates anything; prompts without images (``visual`` all ``None``) are not refused."""
    engine = make()
    assert not engine.capabilities.images
    with pytest.raises(ConfigError) as err:
        engine.generate([[5, 6], [7]], PARAMS, visual=[None, IMAGE])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"the {type(engine).__name__} engine does not generate from image prompts")
    assert message.endswith("use --engine hf or vllm")
    if isinstance(engine, TextEngine):
        assert engine.calls == 0
        assert len(engine.generate([[5, 6], [7]], PARAMS, visual=[None, None])) == 2
        assert engine.calls == 1


def test_generate_prompts_hands_images_only_to_an_engine_that_takes_them():
    """``generate_prompts`` passes ``visual`` only where a prompt has images, and refuses them in one line for an
    engine that declares no image support, without calling its ``generate``."""
    text = Prompt(0, "c=", [5], "r", "row 0", {}, None, None)
    image = Prompt(1, "c=", [5], "r", "row 1", {}, None, IMAGE)
    engine = TextEngine()
    assert [len(row) for row in generate_prompts(engine, [text, text], PARAMS)] == [2, 2]
    assert engine.calls == 1
    with pytest.raises(ConfigError, match=r"^the TextEngine engine does not generate from image prompts") as err:
        generate_prompts(engine, [text, image], PARAMS)
    assert "\n" not in str(err.value) and engine.calls == 1

    class ImageEngine(TextEngine):
        capabilities = EngineCapabilities(images=True)

        def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                     visual: Visual | None = None) -> list[list[Generation]]:
            self.visual = visual
            return super().generate(prompts, params, visual)

    taking = ImageEngine()
    generate_prompts(taking, [text, image], PARAMS)
    assert taking.calls == 1 and taking.visual == [None, IMAGE]


def test_each_engine_declares_its_capabilities_in_one_place():
    """What the trainer, the engine workers and the generative reward read: images (hf, vllm, the pool's engine,
    which forwards them to the configured engine's copies), interruption between tokens (hf's own loop, not
    ``model.generate``; SGLang), processes of its own (SGLang), a mixture of experts' routes (hf's own loop); a plugin
    engine declares none by default."""
    assert HFEngine().capabilities == EngineCapabilities(images=True, interrupt=True, routes=True)
    assert HFEngine(use_generate=True).capabilities == EngineCapabilities(images=True, interrupt=False)
    assert HFEngine.capabilities.interrupt  # the instance's options changed its own, not the class's
    assert SGLangEngine.capabilities == EngineCapabilities(interrupt=True, starts_processes=True)
    assert PoolEngine.capabilities.images
    assert TextEngine().capabilities == EngineCapabilities() == EngineCapabilities(False, False, False, False)
    with pytest.raises(AttributeError):
        HFEngine.capabilities.images = False  # frozen: declared, not toggled at run time


def test_the_base_next_token_logprobs_takes_images_and_says_it_gives_none():
    """``next_token_logprobs`` declares ``visual`` as ``generate`` does; an engine that does not override it
    raises ``NotImplementedError`` naming the engine, with or without images."""
    with pytest.raises(NotImplementedError, match="the TextEngine engine does not give next-token log-probabilities"):
        TextEngine().next_token_logprobs([[5]], [1, 2], visual=[IMAGE])


def test_an_engine_that_declares_a_capability_by_its_former_name_is_refused_in_one_line():
    """``supports_images = True`` (the contract's former spelling) would now be read by nothing, and the engine's
    images refused at run time: the class is refused where it is defined, naming the engine and the new place."""
    with pytest.raises(TypeError) as err:

        class OldPlugin(TextEngine):
            supports_images = True

    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("engine OldPlugin sets supports_images: an engine declares what it supports in "
                              "capabilities = EngineCapabilities(")
