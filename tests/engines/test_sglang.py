"""SGLang engine: translation to and from SGLang's formats (any venv); the real engine on CPU (marked ``sglang``).

The ``sglang``-marked tests run where SGLang is installed: on CPUs its own venv made by
scripts/install_sglang_cpu.sh (the last part of .ci/run); they are skipped elsewhere.
"""

import importlib.util

import pytest
import torch
from conftest import engine_logprob_gap, greedy_with_updates, injected_updates, interrupted_runs, stale_after_train_step

from gcore import SamplingParams
from gcore.engines.sglang import buckets, group_outputs, sampling_dict, to_generation
from gcore.errors import GcoreError
from gcore.model import ModelSource


def _output(tokens, logprobs, reason):
    return {
        "text": "",
        "output_ids": tokens,
        "meta_info": {
            "finish_reason": reason,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, tokens, strict=False)],
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
        (_output([1], [-0.1], {"type": "abort", "message": "out of memory"}),
         "SGLang aborted a request: out of memory"),
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


def test_a_checkpoint_without_architectures_gets_one(tmp_path):
    """SGLang picks the model class from config.json's ``architectures``; the embedded model's has none."""
    import json

    from gcore.engines.sglang import _architecture_override
    from gcore.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert json.loads(_architecture_override(str(tmp_path))) == {"architectures": ["Qwen2ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert _architecture_override(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nope"}))
    with pytest.raises(ConfigError, match=r"config.json: no 'architectures' .* model_type 'nope'"):
        _architecture_override(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_missing_sglang_names_the_extra():
    from gcore.engines.sglang import SGLangEngine
    from gcore.errors import ConfigError

    with pytest.raises(ConfigError,
                       match=r"--engine sglang needs SGLang .*gcore\[sglang\].*scripts/install_sglang_cpu.sh"):
        SGLangEngine()


@pytest.mark.sglang
def test_bad_arguments_name_the_flag():
    from gcore.engines.sglang import SGLangEngine
    from gcore.errors import ConfigError

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("the missing-install error comes first")
    with pytest.raises(ConfigError, match="--engine.cpu_release must be one of restart, resident, not 'swap'"):
        SGLangEngine(cpu_release="swap")


@pytest.mark.sglang
def test_an_engine_worker_gets_the_configuration_and_starts_sglang_itself():
    """An engine worker (``--placement.workers``) is sent the configured engine: it pickles without its call thread
    (the copy gets one of its own) and asks for a non-daemonic worker, since SGLang starts processes of its own; an
    engine already set up (its SGLang processes this process's) is refused in one line."""
    import pickle

    from gcore.engines.sglang import SGLangEngine

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("the missing-install error comes first")
    engine = SGLangEngine(cpu_kv_cache_tokens=1234, cpu_threads=1)
    copy = pickle.loads(pickle.dumps(engine))
    assert (copy.cpu_kv_cache_tokens, copy.cpu_threads, copy.engine) == (1234, 1, None)
    assert copy._calls is not engine._calls and copy._calls.submit(lambda: 7).result() == 7
    assert SGLangEngine.capabilities.starts_processes
    engine.engine = object()  # as after setup
    with pytest.raises(TypeError, match="a set-up SGLangEngine cannot be sent to another process .* send it before "
                                        "setup$"):
        pickle.dumps(engine)


@pytest.mark.integration
@pytest.mark.sglang
def test_torchvision_imports_next_to_the_cpu_torch():
    """SGLang imports torchvision; the registry's (a CUDA build) imports next to a CPU torch only with the shim."""
    import os
    import subprocess
    import sys

    pytest.importorskip("sglang")
    code = "import torchvision.extension as e; from torchvision.io import decode_jpeg; print(e._has_ops())"
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    if run.stdout.strip() == "False":  # torchvision's own extension did not load: the shim defined its ops
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # torch skips its backend hooks, the shim too
        without = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env)
        assert without.returncode != 0 and "torchvision::nms does not exist" in without.stderr


# ---- the real engine (CPU in SGLang's own venv; the cuda variants on a GPU machine with SGLang) ----

PARITY = 1e-4  # max |engine - trainer| logprob in float32 on CPU; measured about 1e-6 (see docs/engines.md)


def _engine_and_backend(tmp_path, device, **engine_args):
    pytest.importorskip("sglang")
    from lightning_fabric import Fabric

    from gcore import GRPO, ModelConfig, TorchBackend
    from gcore.engines.sglang import SGLangEngine
    from gcore.model import char_tokenizer, materialize

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("SGLang's CPU engine is installed on CPU-only machines")
    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(num_hidden_layers=2), tokenizer, 0, str(tmp_path / "model"))
    fabric = Fabric(accelerator=device, devices=1)
    backend = TorchBackend(lr=1e-2)
    backend.setup(fabric, ModelSource(path), GRPO(), embedded=True)
    engine = SGLangEngine(cpu_kv_cache_tokens=4096, timeout_s=300, **engine_args)
    engine.setup(ModelSource(path), fabric.device)
    return tokenizer, engine, backend



def _children():
    import multiprocessing.resource_tracker as tracker

    import psutil

    tracker_pid = getattr(tracker._resource_tracker, "_pid", None)
    return {p.pid: p.name() for p in psutil.Process().children(recursive=True)
            if p.pid != tracker_pid and p.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.integration
@pytest.mark.sglang
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logprobs_match_the_trainer_before_and_after_a_weight_sync(tmp_path, device):
    # buckets of 10 KiB, smaller than the largest tensor (the 100 x 128 embedding travels alone)
    tokenizer, engine, backend = _engine_and_backend(tmp_path, device, sync_bucket_mb=0.01)
    try:
        params = SamplingParams(n=4, max_new_tokens=12, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
        assert gap < PARITY

        assert stale_after_train_step(engine, backend, tokenizer, params) > 10 * PARITY  # not seen until the sync
        total = sum(t.numel() * t.element_size() for _, t in backend.named_weights())
        assert engine.update_weights(backend.named_weights()) == total
        assert engine.last_sync_buckets > 2
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
        assert gap < PARITY
    finally:
        engine.shutdown()


@pytest.mark.integration
@pytest.mark.sglang
def test_sleep_restarts_the_engine_on_cpu_and_shutdown_leaves_no_process(tmp_path):
    """On CPU, sleep ends SGLang's processes, wake_up starts them from the checkpoint; nothing outlives shutdown.
    Neither start changes this process's root logger (SGLang's own start sets it to errors only, which silenced
    gcore's later warnings)."""
    import logging

    from gcore.errors import GcoreError

    root = logging.getLogger()
    logger_before = (root.level, root.handlers[:])
    before = _children()
    tokenizer, engine, backend = _engine_and_backend(tmp_path, "cpu")
    try:
        assert (root.level, root.handlers) == logger_before
        assert logging.getLogger("gcore.engines.sglang").isEnabledFor(logging.WARNING)
        started = _children().keys() - before.keys()
        assert started and {p.pid for p in engine.processes} == started
        assert any("sglang" in _children()[pid] for pid in started)  # sglang::scheduler, sglang::detokenizer
        params = SamplingParams(n=2, max_new_tokens=8, temperature=0.8, stop_token_ids=(tokenizer.eos_token_id,))
        assert stale_after_train_step(engine, backend, tokenizer, params) > 10 * PARITY
        engine.update_weights(backend.named_weights())

        engine.sleep()
        assert _children() == before  # the memory went with the processes
        with pytest.raises(GcoreError, match="while asleep"):
            engine.generate([[1]], params)
        engine.wake_up()
        assert (root.level, root.handlers) == logger_before
        assert engine.processes and _children().keys() - before.keys() == {p.pid for p in engine.processes}
        with pytest.raises(GcoreError, match="sync the weights before generating"):
            engine.generate([[1]], params)  # it holds the checkpoint's weights, not the trainer's
        engine.update_weights(backend.named_weights())
        gap, _ = engine_logprob_gap(engine, backend, tokenizer, params)
        assert gap < PARITY
        print(f"cpu restart: sleep {engine.last_sleep_seconds:.2f} s, wake {engine.last_wake_seconds:.1f} s")
    finally:
        engine.shutdown()
    assert _children() == before



def _rewards(tmp_path, seed, steps):
    """reward/mean per step of a GRPO run of the ``gcore fit --engine sglang`` command (the default task)."""
    import csv

    from conftest import run_gcore

    root = tmp_path / f"seed{seed}"
    result = run_gcore("fit", "--trainer.default_root_dir", str(root), "--engine", "sglang", "--engine.cpu_threads",
                       "1", "--engine.seed", str(seed), "--trainer.seed", str(seed), "--trainer.max_steps",
                       str(steps), "--trainer.enable_progress_bar", "false", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = root.glob("gcore/version_*/metrics.csv")
    with open(path) as f:
        return [float(row["reward/mean"]) for row in csv.DictReader(f)]


@pytest.mark.integration
@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_grpo_with_sglang_learns(tmp_path, seed):
    """Measured spread (CPU, seeds 1, 2, 3, 42; 30 steps): the mean reward of the first 5 steps is
    0.015-0.019; of steps 11-20 it is 0.09-0.18 (at least 4.8 times, and 0.073 above, the first 5),
    of steps 21-30 0.09-0.31. Asserted: the mean of the last 10 of 20 steps is more than 3 times,
    and 0.05 above, the mean of the first 5."""
    pytest.importorskip("sglang")
    if torch.cuda.is_available():
        pytest.skip("SGLang's CPU engine is installed on CPU-only machines")
    rewards = _rewards(tmp_path, seed, steps=20)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert last > 3 * first and last - first > 0.05, rewards


@pytest.mark.integration
@pytest.mark.sglang
def test_three_turn_episodes_are_the_engines_tokens_and_the_trainers_logprobs(tmp_path):
    """Multi-turn episodes on SGLang (docs/agents.md): each turn continues from the trajectory's ids, and
    the trainer's log-probabilities of the model's tokens equal SGLang's."""
    from conftest import three_turn_trajectory_gap

    tokenizer, engine, backend = _engine_and_backend(tmp_path, "cpu")
    try:
        gap, samples = three_turn_trajectory_gap(engine, backend, tokenizer)
        assert all(s.turns == 3 and s.finished for s in samples)
        assert gap < PARITY
    finally:
        engine.shutdown()


# -- partial rollouts (--trainer.partial_rollouts): generate streams and stops when ``interrupt`` says so ------------

LONG = [3 + i % 40 for i in range(150)]  # a long prompt: its prefix is in SGLang's radix cache when continued
PROMPTS = [[5, 6, 7], [8, 9], LONG, [10, 11, 12, 13]]
GREEDY = SamplingParams(n=1, max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def two_sglang_policies(tmp_path_factory):
    """A tiny model's checkpoint, an SGLang engine with its weights (old), one with other weights (new), the
    checkpoint's weights and the other ones."""
    pytest.importorskip("sglang")
    from safetensors.torch import load_file

    from gcore import ModelConfig
    from gcore.engines.sglang import SGLangEngine
    from gcore.model import char_tokenizer, materialize

    if torch.cuda.is_available():
        pytest.skip("SGLang's CPU engine is installed on CPU-only machines")
    path = materialize(ModelConfig(num_hidden_layers=2), char_tokenizer(), 0,
                       str(tmp_path_factory.mktemp("sglang_policy") / "model"))
    old, new = (SGLangEngine(cpu_kv_cache_tokens=4096, cpu_threads=1, timeout_s=300) for _ in range(2))
    try:
        for engine in (old, new):
            engine.setup(ModelSource(path), torch.device("cpu"))
        generator = torch.Generator().manual_seed(1)
        original = sorted(load_file(f"{path}/model.safetensors").items())
        weights = [(name, t + 0.5 * torch.randn(t.shape, generator=generator)) for name, t in original]
        new.update_weights(weights)
        yield path, old, new, original, weights
    finally:
        for engine in (old, new):
            engine.shutdown()


def _close(got, want, atol=1e-5):
    return torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=atol)


@pytest.mark.integration
@pytest.mark.sglang
@pytest.mark.parametrize("k", [1, 12])
def test_an_interrupt_stops_sglang_with_the_tokens_so_far(two_sglang_policies, k):
    """``interrupt`` (asked after each streamed message) turns True at its k-th call: each greedy generation still
    running is a prefix of the uninterrupted one (same ids and log-probabilities), unfinished; with ``n`` > 1 every
    sample of every prompt is returned, in order; the aborted requests leave nothing behind in SGLang. Which
    responses are cut, and where, depends on how SGLang's messages interleave; that some are is certain when k is
    less than the number of requests (one message read per call: some request has none)."""
    _, old, *_ = two_sglang_policies
    assert old.capabilities.interrupt
    whole, cut, sampled = interrupted_runs(old, PROMPTS, GREEDY, k)
    for got, want in zip(cut, whole, strict=True):
        assert got.token_ids == want.token_ids[: len(got.token_ids)]
        assert _close(got.logprobs, want.logprobs[: len(got.logprobs)])
        if len(got.token_ids) < len(want.token_ids):  # cut
            assert not got.finished
        else:
            assert got.finished == want.finished
    if k < len(PROMPTS):
        assert any(len(g.token_ids) < GREEDY.max_new_tokens for g in cut)  # the cut did happen
    assert [len(row) for row in sampled] == [3] * len(PROMPTS)
    if k < 3 * len(PROMPTS):
        assert any(len(g.token_ids) < 12 for row in sampled for g in row)
    for row in sampled:
        for g in row:
            assert len(g.logprobs) == len(g.token_ids) <= 12 and all(lp <= 0 for lp in g.logprobs)
    assert not old.engine.tokenizer_manager.rid_to_state  # nothing left of the aborted requests
    again = [g for (g,) in old.generate(PROMPTS, GREEDY)]
    assert [g.token_ids for g in again] == [g.token_ids for g in whole]
    assert all(_close(a.logprobs, w.logprobs) for a, w in zip(again, whole, strict=True))


def _cuts(g):
    """Where the weight updates cut a continued generation: how many tokens came before each new version."""
    versions = g.versions or []
    return [sum(v < version for v in versions) for version in range(1, max(versions, default=0) + 1)]


@pytest.mark.integration
@pytest.mark.sglang
@pytest.mark.parametrize("cuts", [[3], [2, 6]])
def test_a_partial_rollout_on_sglang_continues_every_unfinished_response_with_the_new_weights(two_sglang_policies,
                                                                                               cuts):
    """The worker's runtime on an SGLang engine, the update's arrival injected (``pending`` turns true at its k-th
    call, after a streamed message): each response's tokens before its cut are the old weights', those after it the
    new weights' continuation (not served from the old weights' prefix cache), one more version per update. Where
    each response is cut depends on how SGLang's messages interleave: the reference is built per response. The
    first update is certain to cut (it comes before every request has sent a message)."""
    from gcore.engines.pool import POLICY, RoleSpec, _WorkerRuntime
    from gcore.engines.sglang import SGLangEngine

    path, old, new, original, weights = two_sglang_policies
    runtime = _WorkerRuntime({POLICY: RoleSpec(SGLangEngine(), ModelSource(path))}, release=True,
                             device=torch.device("cpu"))
    old.update_weights(original)  # the checkpoint's weights (an earlier case left the new ones)
    runtime.engines[POLICY], runtime.role = old, POLICY  # what ``switch`` would set up, without a 3rd engine
    pending, take_sync, updates = injected_updates(runtime, weights, set(cuts))  # pending: once per message
    try:
        out = runtime.generate_partial(POLICY, PROMPTS, GREEDY, None, None, pending, take_sync)
    finally:
        old.update_weights(original)
    assert old.interrupt is None  # put back
    assert len(updates) == len(cuts)
    for prompt, (got,) in zip(PROMPTS, out, strict=True):
        (want,) = greedy_with_updates(old, new, [prompt], GREEDY, _cuts(got))
        assert got.token_ids == want.token_ids
        assert got.versions == want.versions
        assert got.finished == want.finished
        # PARITY, not 1e-5: the reference decodes each prompt alone, the runtime them all in one batch (measured:
        # at most about 2e-5 apart)
        assert _close(got.logprobs, want.logprobs, PARITY)
    assert any(g.versions and max(g.versions) == len(cuts) for (g,) in out)  # the cuts did happen
    assert any(0 < _cuts(g)[0] < len(g.token_ids) for (g,) in out if g.versions)  # old tokens, then new ones


@pytest.mark.integration
@pytest.mark.sglang
def test_sglang_in_an_engine_worker_continues_after_a_sync_and_ends_with_the_pool(two_sglang_policies):
    """SGLang in an engine worker (a non-daemonic process: SGLang starts processes of its own), partial rollouts
    through the pool as ``gcore fit`` runs them: the weight sync, sent while the worker generates and loaded from the
    pool's shared memory, stops the generation; each response is the old weights' first tokens, then the new weights'
    greedy continuation (the reference is built per response: where each is cut depends on how SGLang's messages
    interleave). Closing the pool ends the worker and every process SGLang started in it."""
    import psutil

    from gcore.engines.pool import POLICY, RoleSpec, WorkerPool
    from gcore.engines.sglang import SGLangEngine

    path, old, new, original, weights = two_sglang_policies
    old.update_weights(original)  # the checkpoint's weights, which the worker starts from
    prompts = [p for p in PROMPTS if p is not LONG]  # 100 new tokens after LONG would pass the 256-token context
    params = SamplingParams(n=1, max_new_tokens=100, temperature=0.0)
    before = _children()
    pool = WorkerPool(1, {POLICY: RoleSpec(SGLangEngine(cpu_kv_cache_tokens=4096, cpu_threads=1, timeout_s=300),
                                           ModelSource(path))}, [POLICY], threads=1, retries=0)
    try:
        assert not pool.processes[0].daemon
        pool.queue_syncs = pool.partial_rollouts = True
        in_flight = pool.submit_generate(POLICY, prompts, params, [0])
        pool.sync_weights(weights)
        got = [g for (g,) in pool.collect_generate(in_flight)]
        pool.wait(pool._syncs)
        assert pool._side == {}  # the sync was answered
    finally:
        pool.close()
        started = [psutil.Process(pid) for pid in _children().keys() - before.keys()]
        psutil.wait_procs(started, timeout=60)  # a worker killed by ``close`` takes SGLang's processes with it
    assert _children() == before
    assert any(g.versions for g in got), "the sync did not land during the generation"
    for prompt, g in zip(prompts, got, strict=True):
        (want,) = greedy_with_updates(old, new, [prompt], params, _cuts(g))
        assert g.token_ids == want.token_ids
        assert g.versions == want.versions
        assert g.finished == want.finished
        assert _close(g.logprobs, want.logprobs, PARITY)  # the worker decodes them in one batch, the reference alone


@pytest.mark.integration
@pytest.mark.sglang
@pytest.mark.slow  # a CLI run with an SGLang engine worker
@pytest.mark.timeout(1200)  # SGLang's start and 4 steps: 94 s on the quiet 2-core machine, over 600 s beside a busy one
def test_fit_on_an_sglang_engine_worker_trains_within_the_staleness_bound(tmp_path):
    """``gcore fit`` as a user types it with SGLang in an engine worker, K = 1 and partial rollouts. Every step trains:
    its update is finite and not skipped, every sample is trained and the gradient is not zero (the reward varies within
    groups). The cuts are made certain by construction, not by timing (``GCORE_TEST_PARTIAL_HOLD``, as in
    tests/trainer/test_partial_rollouts.py: the worker holds a rollout started ahead after its 4th token until the
    update comes): every step after the first trains cut samples with their old tokens' log-probabilities
    (``assert_partial_rollouts_cut``). The plain K = 0 run on an SGLang worker was a second case (150-200 s of CI); its
    path, a worker generating and taking a sync, is
    ``test_sglang_in_an_engine_worker_continues_after_a_sync_and_ends_with_the_pool``."""
    import math

    from conftest import assert_partial_rollouts_cut, fit_rows

    from gcore.engines.pool.worker import HOLD_ENV

    pytest.importorskip("sglang")  # the main suite has no SGLang: its CI part runs this test
    if torch.cuda.is_available():
        pytest.skip("SGLang's CPU engine is installed on CPU-only machines")
    rows = fit_rows(tmp_path, "--engine", "sglang", "--engine.cpu_threads", "1", "--placement.workers", "1",
                    "--trainer.max_staleness", "1", "--trainer.partial_rollouts", "true", timeout=1100,
                    env={HOLD_ENV: "4"})
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    for row in rows:
        assert row["skipped_updates"] == "0.0" and math.isfinite(float(row["grad_norm"])), row
        assert float(row["samples/trained"]) == float(row["samples/total"]) > 0, row
        assert float(row["grad_norm"]) > 0, row
    assert_partial_rollouts_cut(rows)
