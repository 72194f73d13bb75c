"""The one-controller baseline (``--trainer.controllers 1``) on CPU (gloo, 2 processes)."""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import FAST, RECORDING_REWARD, spawn
from lightning_fabric import Fabric

from gcore import GRPO, PPO, ModelConfig, TorchBackend
from gcore.controller import StageTimer, StepRecord
from gcore.engines.hf import HFEngine
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.placement.static import StaticPlacement
from gcore.rewards.rule import TargetCharReward
from gcore.single_controller import SingleController, recv_tensors, send_tensors
from gcore.testing import set_up
from gcore.tracing import read_samples
from gcore.types import Prompt, Sample, SamplingParams, collate

pytestmark = [pytest.mark.slow, pytest.mark.integration]


RECORDING_ENGINE = '''
import json, os
from gcore.engines.hf import HFEngine

class RecordingEngine(HFEngine):
    def generate(self, prompts, params):
        path = os.path.join(os.environ["GCORE_TEST_LOG"], "generated-rank%s.jsonl" % os.environ.get("LOCAL_RANK", "0"))
        with open(path, "a") as f:
            for p in prompts:
                f.write(json.dumps(p) + "\\n")
        return super().generate(prompts, params)
'''



# -- the tensor transport -----------------------------------------------------------------------

MESSAGE = [torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.tensor([0.5, -1.25]), torch.tensor([True, False]),
           torch.empty(0), torch.ones(2, 0, 4), torch.tensor([[1.0]], dtype=torch.float64)]


def _exchange(fabric, out):
    if fabric.global_rank == 0:
        send_tensors(MESSAGE, 1)
        torch.save(recv_tensors(1), out)
    else:
        send_tensors([t * 2 if t.dtype != torch.bool else ~t for t in recv_tensors(0)], 0)


def test_tensors_travel_with_their_dtypes_and_shapes(tmp_path):
    out = str(tmp_path / "back.pt")
    spawn(2, _exchange, out)
    back = torch.load(out)
    expected = [t * 2 if t.dtype != torch.bool else ~t for t in MESSAGE]
    assert len(back) == len(expected)
    for got, want in zip(back, expected, strict=False):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


# -- prepare + train through one controller equals one process training on the whole batch ----

def _samples(tokenizer):
    gen = torch.Generator().manual_seed(5)
    rewards = [1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.3]
    samples = []
    for row, (reward, group) in enumerate(zip(rewards, [0, 0, 1, 1, 2, 2, 2], strict=False)):
        prompt = torch.randint(4, 60, (2 + row % 3,), generator=gen).tolist()
        response = torch.randint(4, 60, (3 + row % 4,), generator=gen).tolist()
        feature = torch.full((5,), float(row))
        samples.append(Sample(Prompt(group, "p", prompt, metadata={"feature": feature}), group, response,
                              [0.0] * len(response), "r", True, reward))
    return samples


def _algorithm(name):
    # one epoch, one mini-batch: with more, each rank shuffles and splits its own rows (as with parallel
    # controllers), so the mini-batches differ from those of one process by construction
    return PPO(epochs=1, mini_batches=1) if name == "ppo" else GRPO(kl_coef=0.05)


def _one_controller(fabric, model_dir, out, name):
    tokenizer = char_tokenizer()
    algorithm = _algorithm(name)
    backend = TorchBackend(lr=1e-2, micro_batch_size=2)
    backend.setup(fabric, ModelSource(model_dir), algorithm, embedded=True)
    sampling = SamplingParams(n=2, max_new_tokens=6)
    controller = SingleController(fabric, HFEngine(), TargetCharReward(), algorithm, backend, StaticPlacement(),
                                  tokenizer, sampling)
    samples = _samples(tokenizer) if fabric.global_rank == 0 else []
    record = StepRecord(0, [], StageTimer(), samples=samples, kept=samples)
    batch = controller.prepare(record)
    metrics = backend.train(batch, set_up(algorithm, 6))
    torch.save({"metrics": metrics, "weights": {k: v.clone() for k, v in backend.named_weights()},
                "features": batch.features}, out % fabric.global_rank)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_one_controller_over_two_ranks_computes_the_update_of_one_process(tmp_path, name):
    model_dir = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(),
                            0, str(tmp_path / "model"))
    # reference: one process prepares and trains on the whole batch
    fabric = Fabric(accelerator="cpu", devices=1)
    algorithm = _algorithm(name)
    backend = TorchBackend(lr=1e-2, micro_batch_size=2)
    backend.setup(fabric, ModelSource(model_dir), algorithm, embedded=True)
    batch = collate(_samples(char_tokenizer()), char_tokenizer().pad_token_id, 1.0)
    batch.response_mask = algorithm.loss_mask(batch)
    if algorithm.needs_critic:
        batch.values = backend.compute_values(batch)
    if algorithm.needs_old_logprobs:
        batch.old_logprobs = backend.compute_logprobs(batch, "policy")
    if algorithm.needs_reference:
        batch.ref_logprobs = backend.compute_logprobs(batch, "reference")
    batch.advantages = algorithm.advantages(batch)
    single = backend.train(batch, set_up(algorithm, 6))
    single_weights = {k: v.clone() for k, v in backend.named_weights()}

    out = str(tmp_path / "rank%d.pt")
    spawn(2, _one_controller, model_dir, out, name)
    ranks = [torch.load(out % r) for r in range(2)]
    # rank 0 kept rows 0-3 of the batch, rank 1 got rows 4-6 with their features
    assert torch.equal(ranks[0]["features"][:, 0], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert torch.equal(ranks[1]["features"][:, 0], torch.tensor([4.0, 5.0, 6.0]))
    for key, tensor in single_weights.items():
        assert torch.equal(ranks[0]["weights"][key], ranks[1]["weights"][key]), key
        torch.testing.assert_close(ranks[0]["weights"][key], tensor, rtol=0, atol=2e-5)
    for key in ("loss", "entropy", "grad_norm"):
        assert ranks[0]["metrics"][key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key


# -- end to end through the CLI -----------------------------------------------------------------

def test_one_controller_scores_everything_and_every_rank_generates(tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDING_REWARD)
    (tmp_path / "recording_engine.py").write_text(RECORDING_ENGINE)
    rows = [{"prompt": f"{i}=", "answer": str(i % 10)} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "GCORE_TEST_LOG": str(logs),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "gcore", "fit", *FAST, "--trainer.devices", "2", "--trainer.accelerator", "cpu",
         "--trainer.controllers", "1", "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path / "runs"),
         "--data.path", str(tmp_path / "d.jsonl"), "--data.prompts_per_step", "5", "--data.shuffle", "false",
         "--data.synthetic_feature_mb", "0.01", "--engine", "recording_engine.RecordingEngine",
         "--reward", "python", "--reward.function", f"{tmp_path}/recorder.py:score"],
        capture_output=True, text=True, env=env, timeout=400)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(logs)) == ["generated-rank0.jsonl", "generated-rank1.jsonl", "scored-rank0.jsonl"]
    scored = [json.loads(line) for line in (logs / "scored-rank0.jsonl").read_text().splitlines()]
    assert sorted(scored) == sorted(f"{i}=" for i in range(5) for _ in range(2) for _ in range(2))  # 2 steps
    generated = {r: len((logs / f"generated-rank{r}.jsonl").read_text().splitlines()) for r in (0, 1)}
    assert generated == {0: 6, 1: 4}  # 5 prompts a step, split 3 + 2, over 2 steps
    (version,) = os.listdir(tmp_path / "runs" / "gcore")
    with open(tmp_path / "runs" / "gcore" / version / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    assert [m["samples/total"] for m in metrics] == ["10.0", "10.0"]
    # rollout tracing: rank 0 holds every sample and writes alone (8 of each step's 10, the default bound)
    assert [p.name for p in (tmp_path / "runs" / "gcore" / version).glob("samples*.jsonl")] == ["samples.jsonl"]
    traced = read_samples(str(tmp_path / "runs" / "gcore" / version))
    assert [r["step"] for r in traced] == [0] * 8 + [1] * 8 and {r["rank"] for r in traced} == {0}
    # rank 0 sent the prompts and rows (with their 10 kB features) to rank 1
    assert float(metrics[0]["controller/sent_gb"]) > 4 * 10_000 / 1e9


def test_controllers_must_be_one_or_one_per_process(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gcore", "fit", *FAST, "--trainer.devices", "2", "--trainer.accelerator", "cpu",
         "--trainer.controllers", "3", "--trainer.default_root_dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "--trainer.controllers 3: valid choices are 1" in result.stderr
