"""SGLang engine: translation to and from SGLang's documented formats (CPU), the real engine on GPU."""

import importlib.util

import pytest
import torch

from gcore import SamplingParams
from gcore.engines.sglang import buckets, group_outputs, sampling_dict, to_generation
from gcore.errors import GcoreError


def _output(tokens, logprobs, reason):
    return {
        "text": "",
        "output_ids": tokens,
        "meta_info": {
            "finish_reason": reason,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, tokens)],
            "completion_tokens": len(tokens),
        },
    }


def test_sampling_parameters():
    d = sampling_dict(SamplingParams(n=4, max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(2,)))
    assert d == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 9, "stop_token_ids": [2],
                 "skip_special_tokens": False, "no_stop_trim": True}
    assert sampling_dict(SamplingParams(top_k=5))["top_k"] == 5


def test_outputs_become_generations_grouped_per_prompt():
    outputs = [
        _output([5, 6, 2], [-0.1, -0.2, -0.3], {"type": "stop", "matched": 2}),
        _output([7, 8, 9], [-1.0, -2.0, -3.0], {"type": "length", "length": 3}),
        _output([4], [-0.5], {"type": "stop", "matched": 2}),
        _output([3, 3, 3], [-0.4, -0.4, -0.4], {"type": "length", "length": 3}),
    ]
    grouped = group_outputs(outputs, num_prompts=2, n=2)
    assert [len(g) for g in grouped] == [2, 2]
    first = grouped[0][0]
    assert first.token_ids == [5, 6, 2] and first.logprobs == pytest.approx([-0.1, -0.2, -0.3]) and first.finished
    assert not grouped[0][1].finished and grouped[1][0].finished


@pytest.mark.parametrize(
    "output, message",
    [
        (_output([1], [-0.1], {"type": "abort", "message": "out of memory"}), "SGLang aborted a request: out of memory"),
        ({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}}, "no output_token_logprobs"),
        ({**_output([1, 2], [-0.1, -0.2], {"type": "stop"}), "output_ids": [1]}, "disagree"),
    ],
)
def test_bad_outputs_fail_clearly(output, message):
    with pytest.raises(GcoreError, match=message):
        to_generation(output)


def test_output_count_must_match():
    with pytest.raises(GcoreError, match="3 outputs for 2 prompts x 2 samples"):
        group_outputs([_output([1], [-0.1], {"type": "stop"})] * 3, 2, 2)


def test_weight_buckets():
    weights = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(300)), ("d", torch.zeros(10))]
    sizes = [[name for name, _ in b] for b in buckets(weights, max_bytes=800)]
    assert sizes == [["a", "b"], ["c"], ["d"]]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_missing_sglang_names_the_extra():
    from gcore.engines.sglang import SGLangEngine
    from gcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--engine sglang needs SGLang .*gcore\[sglang\]"):
        SGLangEngine()


@pytest.mark.gpu
def test_sglang_logprobs_match_trainer_after_weight_update(tmp_path):
    pytest.importorskip("sglang")
    from lightning.fabric import Fabric

    from gcore import GRPO, ModelConfig, TorchBackend
    from gcore.engines.sglang import SGLangEngine
    from gcore.model import char_tokenizer, materialize
    from gcore.testing import make_sample
    from gcore.types import collate

    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(num_hidden_layers=2), tokenizer, 0, str(tmp_path / "m"))
    fabric = Fabric(accelerator="cuda", devices=1)
    backend = TorchBackend(lr=1e-2)
    backend.setup(fabric, path, torch.float32, False, GRPO(), embedded=True)
    engine = SGLangEngine(mem_fraction_static=0.3)
    engine.setup(path, fabric.device, torch.float32, False)
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
    free_before, _ = torch.cuda.mem_get_info()
    engine.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    engine.wake_up()
    assert free_asleep > free_before
    received = engine.update_weights(backend.named_weights())
    assert received > 0
    prompt_ids = tokenizer("3=")["input_ids"]
    out = engine.generate([prompt_ids], params)[0]
    samples = [make_sample("3=", "", group=0) for _ in out]
    for s, g in zip(samples, out):
        s.prompt.token_ids, s.response_ids, s.response_logprobs = prompt_ids, g.token_ids, g.logprobs
    batch = collate(samples, tokenizer.pad_token_id, params.temperature)
    gap = ((backend.compute_logprobs(batch, "policy") - batch.engine_logprobs) * batch.response_mask).abs().max()
    assert float(gap) < 1e-2
    engine.shutdown()
