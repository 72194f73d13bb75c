"""A VLM as the generative judge: it sees the images of the policy's image prompts (docs/multimodal.md, "Rewards").

The judge is the embedded tiny VLM with random weights: these tests show the plumbing (the images reach the
judge's forward, batched as one by one, refusals), not the quality of its judging.
"""

from dataclasses import replace

import pytest
import torch
from conftest import COLOURS, image_prompts, image_samples
from PIL import Image

from gcore.errors import ConfigError
from gcore.model import ModelConfig, char_tokenizer, load_tokenizer, materialize
from gcore.rewards.generative import GenerativeReward
from gcore.types import Prompt, Sample, SamplingParams, VisualInputs
from gcore.vision import encode


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    config = ModelConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    return materialize(config, load_tokenizer(config, vision=True), seed=0,
                       workdir=str(tmp_path_factory.mktemp("vlm")), vision=True)


@pytest.fixture(scope="module")
def judge(vlm_dir):
    reward = GenerativeReward(vlm_dir, template="Q: {prompt} A: {response}. Right?")
    reward.setup("cpu")
    assert reward.processor is not None  # an image-text-to-text judge
    return reward


def image_sample(processor, images, text="c=", response="rrrr", index=0):
    token_ids, visual = encode(processor, text, images, f"row {index}")
    return Sample(Prompt(index, text, token_ids, "r", f"row {index}", {}, None, visual), 0, [5], [0.0], response, True)


def text_sample(text="c=", response="rrrr", index=0):
    return Sample(Prompt(index, text, [5, 6], "r", f"row {index}"), 0, [5], [0.0], response, True)


def direct(judge, text, images):
    """The verdict from the judge model's own forward on its processor's inputs for the judge prompt (transformers
    computes the M-RoPE positions itself): the reference the reward must equal."""
    message = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    processor = judge.processor
    templated = processor.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[templated], images=images, return_tensors="pt")
    inputs = {k: torch.as_tensor(v) for k, v in inputs.items()}
    image_token = judge.engine.model.config.image_token_id  # what transformers' own processor would add
    inputs.setdefault("mm_token_type_ids", torch.eq(inputs["input_ids"], image_token).int())
    with torch.no_grad():
        logits = judge.engine.model(**inputs, use_cache=False).logits[0, -1]
    logp = torch.log_softmax(logits.double(), dim=-1)
    yes, no = torch.logsumexp(logp[judge.yes_ids], 0), torch.logsumexp(logp[judge.no_ids], 0)
    return float(torch.sigmoid(yes - no))


def test_the_judge_sees_the_images_and_equals_a_direct_forward(judge):
    processor = judge.processor
    red, blue = [Image.new("RGB", (56, 56), COLOURS[0])], [Image.new("RGB", (56, 56), COLOURS[1])]
    scores = judge.score([image_sample(processor, red), image_sample(processor, blue)])
    assert abs(scores[0] - scores[1]) > 1e-6, scores  # the same text, other images: another verdict
    filled = "Q: c= A: rrrr. Right?"
    assert scores[0] == pytest.approx(direct(judge, filled, red), abs=1e-5)
    assert scores[1] == pytest.approx(direct(judge, filled, blue), abs=1e-5)
    # the judge's prompt is the images then the filled template, through its chat template
    ids, visual = judge.judge_inputs(image_sample(processor, red))
    assert visual is not None and ids.count(judge.engine.model.config.image_token_id) == 4


def test_batched_scoring_equals_one_by_one(judge, vlm_dir):
    """Prompts of different lengths (left padding), one with two images of other sizes, one without images."""
    processor = judge.processor
    samples = [
        image_sample(processor, [Image.new("RGB", (56, 56), COLOURS[0])], "c=", "rr", 0),
        image_sample(processor, [Image.new("RGB", (28, 56), COLOURS[1]), Image.new("RGB", (84, 56), COLOURS[2])],
                     "what colour=", "bbbbbbbb", 1),
        text_sample("c=", "g", 2),
        image_sample(processor, [Image.new("RGB", (56, 56), COLOURS[2])], "two=", "ggg", 3),
    ]
    batched = judge.score(samples)
    alone = GenerativeReward(vlm_dir, template=judge.template, batch_size=1)
    alone.setup("cpu")
    one_by_one = alone.score(samples)
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert len(set(round(v, 7) for v in batched)) == 4


def test_a_vlm_judge_on_text_and_a_text_judge_on_images(judge, tmp_path):
    """A VLM judge on a text-only sample reads the text (its engine's text path); a text-only judge on an image
    prompt judges its text as before; ``images false`` makes a VLM judge read the text only."""
    sample = text_sample("c=", "rrrr")
    (score,) = judge.score([sample])
    ids = judge._encode(judge.judge_prompt(sample))
    logp = torch.tensor(judge.engine.next_token_logprobs([ids], judge.yes_ids + judge.no_ids)[0], dtype=torch.float64)
    yes = len(judge.yes_ids)
    expected = torch.sigmoid(torch.logsumexp(logp[:yes], 0) - torch.logsumexp(logp[yes:], 0))
    assert score == pytest.approx(float(expected), abs=1e-9)

    red = image_sample(judge.processor, [Image.new("RGB", (56, 56), COLOURS[0])])
    blue = image_sample(judge.processor, [Image.new("RGB", (56, 56), COLOURS[1])])
    blind = GenerativeReward(judge.path, template=judge.template, images=False)
    blind.setup("cpu")
    a, b = blind.score([red, blue])
    assert a == b and blind.processor is None

    text_dir = materialize(ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=64),
                           char_tokenizer(), seed=0, workdir=str(tmp_path))
    text_judge = GenerativeReward(text_dir)
    text_judge.setup("cpu")
    assert text_judge.processor is None
    a, b = text_judge.score([red, blue])
    assert a == b and 0 < a < 1


def test_free_text_verdicts_take_the_images_through_the_engine(vlm_dir):
    """``yes_no``: the judge generates with the images (the engine's image prompts); a random judge's verdicts are
    unparsable, counted."""
    reward = GenerativeReward(vlm_dir, verdict="yes_no", max_new_tokens=3, unparsable_score=0.5)
    reward.setup("cpu")
    red = image_sample(reward.processor, [Image.new("RGB", (56, 56), COLOURS[0])])
    assert reward.score([red, text_sample()]) == [0.5, 0.5] and reward.last_unparsable == 2


def test_images_processed_otherwise_than_the_judge_would_are_refused_in_one_line(judge):
    """The judge sees the prompt's processed images: a prompt whose tensors its processor would not make (here
    patches of another size, as a policy processor with another patch size gives) is refused, not misread."""
    good = image_sample(judge.processor, [Image.new("RGB", (56, 56), COLOURS[0])])
    pixels = good.prompt.visual.tensors["pixel_values"]
    other = VisualInputs({**good.prompt.visual.tensors, "pixel_values": pixels[:, : pixels.shape[1] // 2]})
    bad = Sample(Prompt(0, "c=", good.prompt.token_ids, "r", "row 7", {}, None, other), 0, [5], [0.0], "r", True)
    with pytest.raises(ConfigError, match="the judge processes images otherwise than the policy") as err:
        judge.score([bad])
    assert "\n" not in str(err.value) and "row 7" in str(err.value)
    llava_like = VisualInputs({"pixel_values": torch.zeros(1, 3, 28, 28)})  # a processor without image_grid_thw
    bad = Sample(Prompt(0, "c=", [5], "r", "row 8", {}, None, llava_like), 0, [5], [0.0], "r", True)
    with pytest.raises(ConfigError, match="otherwise than the policy"):
        judge.score([bad])


def test_an_engine_that_takes_no_images_for_the_verdict_is_refused_in_one_line(vlm_dir):
    """The check reads the configured judge engine, also when copies of it run in engine workers (a pool engine
    forwards the images to them): one whose capabilities do not say ``images`` is refused, not sent."""
    from gcore.engines.base import EngineCapabilities
    from gcore.engines.hf import HFEngine
    from gcore.engines.pool import PoolEngine

    class TextLogprobs(HFEngine):  # an engine that gives next-token log-probabilities of token ids only
        capabilities = EngineCapabilities(interrupt=True)

    reward = GenerativeReward(vlm_dir, engine=TextLogprobs())
    reward.setup("cpu")
    red = image_sample(reward.processor, [Image.new("RGB", (56, 56), COLOURS[0])])
    assert 0 < reward.score([text_sample()])[0] < 1  # text prompts are judged as before
    reward._use_engine(PoolEngine(None, "judge", []))  # type: ignore[arg-type]  # never reached: refused first
    with pytest.raises(ConfigError, match="the TextLogprobs judge engine takes no images for --reward.verdict "
                                          "probability; use --reward.engine hf") as err:
        reward.score([red])
    assert "\n" not in str(err.value)


def blanked(sample: Sample) -> Sample:
    """``sample`` with its prompt's images blank (zero pixel values: a mid-grey image), the tokens unchanged."""
    visual = sample.prompt.visual
    assert visual is not None
    tensors = {**visual.tensors, "pixel_values": torch.zeros_like(visual.tensors["pixel_values"])}
    return replace(sample, prompt=replace(sample.prompt, visual=VisualInputs(tensors)))


@pytest.mark.integration
@pytest.mark.slow
def test_the_probability_verdict_with_images_in_judge_workers_equals_the_in_process_one(judge):
    """Two judge engine workers (dynamic placement's judge partition): each request carries its prompts' images,
    and the verdicts equal those of this process's hf engine on the same prompts and images within 1e-5; blank
    images give other verdicts, so the images reached the workers' forward."""
    from gcore.engines.hf import HFEngine
    from gcore.engines.pool import JUDGE, PoolEngine, RoleSpec, WorkerPool

    torch.manual_seed(0)
    samples = image_samples(judge.engine, judge.tokenizer, image_prompts(judge.processor),
                            SamplingParams(n=2, max_new_tokens=4))
    inputs = [judge.judge_inputs(s) for s in samples]
    ids, visual = [i for i, _ in inputs], [v for _, v in inputs]
    candidates = judge.yes_ids + judge.no_ids
    pool = WorkerPool(2, {JUDGE: RoleSpec(HFEngine(), judge.source)}, [JUDGE, JUDGE], threads=1)
    try:
        workers = PoolEngine(pool, JUDGE, [0, 1])
        rows = workers.next_token_logprobs(ids, candidates, visual=visual)
        jobs = pool.submit_split("logprobs", JUDGE, ids, candidates, [0, 1], visual=visual)
        assert len(jobs) == 2 and pool.collect(jobs) == rows  # one request a worker, each with its rows' images
        reward = GenerativeReward(judge.path, template=judge.template)
        reward.judges()[0].use(workers)
        reward.setup("cpu")
        scores, blank = reward.score(samples), reward.score([blanked(s) for s in samples])
    finally:
        pool.close()
    expected = judge.engine.next_token_logprobs(ids, candidates, visual=visual)
    assert torch.allclose(torch.tensor(rows), torch.tensor(expected), atol=1e-5, rtol=0)
    assert scores == pytest.approx(judge.score(samples), abs=1e-5) and reward.last_errors == 0
    assert max(abs(a - b) for a, b in zip(scores, blank, strict=True)) > 1e-4, (scores, blank)


@pytest.mark.integration
@pytest.mark.slow
def test_fit_cli_dynamic_placement_with_a_vlm_judge_on_the_visual_task(vlm_dir, gcore_cli, tmp_path):
    """``gcore fit --data.task shape_colour --placement dynamic`` with the tiny VLM as the judge: its worker reads
    the probability verdict with the prompts' images, which never fails to parse (no reward errors). A random
    judge: this shows that the run works end to end, not that the judge judges well."""
    import csv

    result = gcore_cli("--data.task", "shape_colour", "--placement", "dynamic", "--placement.workers", "2",
                       "--reward", "generative", "--reward.path", vlm_dir, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 engine worker processes, 1 generating and 1 judging at once" in result.stdout
    rows = list(csv.DictReader(next((tmp_path / "runs").rglob("metrics.csv")).open()))
    rows = [r for r in rows if r.get("reward/errors")]
    assert len(rows) == 2  # FAST: 2 steps
    for r in rows:
        assert float(r["reward/errors"]) == 0 and float(r["samples/total"]) == 8
        assert 0 < float(r["reward/mean"]) < 1 and float(r["placement/judge_devices"]) == 1
