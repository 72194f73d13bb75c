"""``--backend.compile`` and ``--engine.compile``: torch.compile'd blocks and decode steps give the eager numbers.

Each test compiles for real (TorchInductor, a C++ compiler on CPU); the first one on a machine takes tens of
seconds, later ones reuse Inductor's on-disk cache.
"""

import pytest
import torch
from conftest import HF_PROMPTS, assert_same_run, hf_checkpoint

from gcore import GRPO, PPO, HFEngine, SamplingParams, TorchBackend
from gcore.backends.torch import transformer_blocks
from gcore.errors import ConfigError
from gcore.model import ModelSource, check_compiler
from gcore.testing import tiny_fit

pytestmark = pytest.mark.slow


def _has_compiler() -> bool:
    try:
        check_compiler("--backend.compile", torch.device("cpu"))
    except ConfigError:
        return False
    return True


needs_compiler = pytest.mark.skipif(not _has_compiler(), reason="TorchInductor needs a C++ compiler on CPU")


def _compiled_graphs(reset: bool = False) -> int:
    """Graphs Dynamo made since the last ``reset``."""
    from torch._dynamo.utils import counters

    if reset:
        torch._dynamo.reset()
        counters.clear()
    return int(counters["stats"]["unique_graphs"])


@needs_compiler
@pytest.mark.parametrize(("share_prompts", "attention"), [(False, None), (True, None), (False, "eager")])
def test_compiled_blocks_train_the_same_run(share_prompts, attention):
    """Three GRPO steps with each block compiled give the eager run's rewards, losses and weights (up to float
    rounding; Inductor fuses and reorders the elementwise work). Micro-batches that share their prompts (here all
    of them with ``share_prompts`` true) run eagerly: no graph for the prompts' KV cache. With eager (matmul)
    attention, which Inductor fuses into the block's graph, the same holds."""
    results = {}
    for compile_ in (True, False):
        _compiled_graphs(reset=True)
        backend = TorchBackend(compile=compile_, share_prompts=share_prompts, micro_batch_size=6,
                               attn_implementation=attention)
        results[compile_] = tiny_fit(steps=3, save_final=True, backend=backend, algorithm=GRPO(kl_coef=0.05))
        graphs = _compiled_graphs()
        assert all((getattr(b, "_compiled_call_impl", None) is not None) == compile_
                   for b in transformer_blocks(backend.hf_model))
        assert backend.hf_model.config._attn_implementation == (attention or "sdpa")
        if not compile_ or share_prompts:
            assert graphs == 0, graphs
        else:  # not one graph per block, step or length: one per (attention mask given or not, torch thread
            # count; the adaptive count is 1 or 2 on two cores, and 1 next to a busy neighbour), backward included
            assert 0 < graphs <= 4, graphs
    assert_same_run(results[True], results[False])


@needs_compiler
def test_the_compiled_decode_step_samples_what_the_eager_step_does(tmp_path):
    """The engine's compiled step: the same greedy tokens and log-probabilities as the eager step, over two batch
    shapes (a second shape recompiles once, with dynamic shapes) and after a weight update."""
    path = hf_checkpoint(tmp_path, "qwen2")
    engines = {}
    for compile_ in (True, False):
        engines[compile_] = HFEngine(compile=compile_)
        engines[compile_].setup(ModelSource(path), torch.device("cpu"))
    greedy = SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    shifted = {name: t + 0.01 for name, t in engines[False].model.state_dict().items()}
    for prompts in (HF_PROMPTS, HF_PROMPTS[:3] + [[1, 4, 4, 4, 4, 4, 4]]):  # another width: another shape
        for update in (False, True):
            if update:
                for engine in engines.values():
                    engine.update_weights(shifted.items())
            out = {c: engines[c].generate(prompts, greedy) for c in engines}
            assert [[g.token_ids for g in group] for group in out[True]] == \
                   [[g.token_ids for g in group] for group in out[False]]
            for a_group, b_group in zip(out[True], out[False], strict=True):
                for a, b in zip(a_group, b_group, strict=True):
                    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert engines[True]._decoder._compiled is not None and engines[False]._decoder._compiled is None


def test_attn_implementation_reaches_every_model_the_backend_runs():
    """``--backend.attn_implementation``: the policy, the reference and the critic all load with it; an unknown
    name is a one-line error naming the option and transformers' choices; sequence parallelism and packing,
    which bring their own attention, refuse it."""
    backend = TorchBackend(attn_implementation="eager")
    tiny_fit(steps=1, backend=backend, algorithm=PPO(kl_coef=0.05))
    models = (backend.hf_model, backend.reference, backend.critic.module.trunk)
    assert [m.config._attn_implementation for m in models] == ["eager"] * 3
    with pytest.raises(ConfigError, match=r"^--backend.attn_implementation nope: .*\"eager\".*sdpa") as error:
        tiny_fit(steps=1, backend=TorchBackend(attn_implementation="nope"))
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="--backend.attn_implementation eager does not apply with --backend.packing"):
        TorchBackend(attn_implementation="eager", packing=True)
    with pytest.raises(ConfigError, match="does not apply with --backend.sequence_parallel_size 2"):
        TorchBackend(attn_implementation="eager", sequence_parallel_size=2)


def test_compile_refuses_what_it_does_not_support(monkeypatch):
    with pytest.raises(ConfigError, match="--backend.compile true does not support --backend.strategy fsdp"):
        TorchBackend(compile=True, strategy="fsdp")
    with pytest.raises(ConfigError, match="--backend.compile true does not support --backend.lora_rank 4"):
        TorchBackend(compile=True, lora_rank=4)
    with pytest.raises(ConfigError, match="does not support --backend.gradient_checkpointing true"):
        TorchBackend(compile=True, gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="--engine.compile true .* --engine.static_cache true"):
        HFEngine(compile=True, static_cache=False)
    with pytest.raises(ConfigError, match="--engine.compile true with --engine.cuda_graphs true on a GPU"):
        HFEngine(compile=True).setup(ModelSource("unused"), torch.device("cuda"))  # refused before any CUDA call
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr("shutil.which", lambda name: None)
    no_compiler = r"--engine.compile true needs a C\+\+ compiler on CPU.* use --engine.compile false$"
    with pytest.raises(ConfigError, match=no_compiler):
        check_compiler("--engine.compile", torch.device("cpu"))
    check_compiler("--engine.compile", torch.device("meta"))  # not a CPU: nothing to check
