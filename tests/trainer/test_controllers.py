"""Parallel controllers on CPU (gloo): sharding, equal results for 1 and 2 controllers, failures, 2 nodes."""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import FAST, RECORDING_REWARD, free_port, spawn
from lightning_fabric import Fabric

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import make_batch, set_up
from gcore.tracing import read_samples

pytestmark = [pytest.mark.slow, pytest.mark.integration]



def _gcore(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "gcore", "fit", *FAST, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def _metrics(root):
    (path,) = [os.path.join(root, "gcore", v, "metrics.csv") for v in os.listdir(os.path.join(root, "gcore"))
               if v.startswith("version_")]
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("balance", ["true", "false"])
def test_every_prompt_once_per_step_over_two_controllers(tmp_path, balance):
    (tmp_path / "recorder.py").write_text(RECORDING_REWARD)
    rows = [{"prompt": f"{i}=", "answer": str(i % 10)} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    logs = tmp_path / "scored"
    logs.mkdir()
    result = _gcore("--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.max_steps", "1",
                    "--trainer.default_root_dir", str(tmp_path / "runs"), "--data.path", str(tmp_path / "d.jsonl"),
                    "--data.prompts_per_step", "5", "--data.balance", balance, "--data.shuffle", "false",
                    "--reward", "python", "--reward.function", f"{tmp_path}/recorder.py:score",
                    env={"GCORE_TEST_LOG": str(logs)})
    assert result.returncode == 0, result.stderr
    per_rank = {name: [json.loads(line) for line in (logs / name).read_text().splitlines()]
                for name in sorted(os.listdir(logs))}
    assert sorted(per_rank) == ["scored-rank0.jsonl", "scored-rank1.jsonl"]  # both controllers generated and scored
    scored = sorted(p for prompts in per_rank.values() for p in prompts)
    assert scored == sorted(f"{i}=" for i in range(5) for _ in range(2))  # 5 prompts x n=2, none twice
    # no prompt on two controllers
    assert set(per_rank["scored-rank0.jsonl"]).isdisjoint(per_rank["scored-rank1.jsonl"])
    first = _metrics(tmp_path / "runs")[0]
    assert first["samples/total"] == "10.0"
    # rollout tracing: each controller wrote its own samples' records to a file of its own in rank 0's run folder
    (run_dir,) = (tmp_path / "runs" / "gcore").iterdir()
    assert sorted(p.name for p in run_dir.glob("samples*.jsonl")) == ["samples.jsonl", "samples.rank1.jsonl"]
    traced = read_samples(str(run_dir))
    assert len(traced) == 10 and {r["rank"] for r in traced} == {0, 1}
    for rank in (0, 1):
        assert sorted(r["prompt"] for r in traced if r["rank"] == rank) == sorted(per_rank[f"scored-rank{rank}.jsonl"])
    assert first["prompt_length/mean"] == "2.0"  # each prompt "i=" is two character tokens


# -- the same update on 1 and on 2 controllers ----------------------------------------------

def _batch():
    batch = make_batch([1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.3], [0, 0, 1, 1, 2, 2, 2], length=7)
    batch.input_ids = torch.randint(4, 60, batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
    batch.attention_mask[1, 5:] = 0  # rows of different lengths
    batch.response_mask[1, 4:] = 0
    batch.attention_mask[4, 6:] = 0
    batch.response_mask[4, 5:] = 0
    batch.advantages = GRPO().advantages(batch)
    return batch


def _train(fabric, model_dir, rows, out, loss_agg):
    backend = TorchBackend(lr=1e-2, micro_batch_size=2)
    backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    batch = _batch()
    metrics = backend.train(batch.select(torch.tensor(rows)), set_up(GRPO(kl_coef=0.0, loss_agg=loss_agg), 6))
    weights = {k: v.clone() for k, v in backend.named_weights()}
    torch.save({"metrics": metrics, "weights": weights}, out % fabric.global_rank)


def _two(fabric, model_dir, out, loss_agg):
    rows = [0, 1, 2, 3] if fabric.global_rank == 0 else [4, 5, 6]  # uneven: 4 and 3 rows
    _train(fabric, model_dir, rows, out, loss_agg)



@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_two_controllers_compute_the_same_update_as_one(tmp_path, loss_agg):
    model_dir = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(),
                            0, str(tmp_path / "model"))
    out = str(tmp_path / "result%d.pt")
    _train(Fabric(accelerator="cpu", devices=1), model_dir, list(range(7)), str(tmp_path / "single%d.pt"), loss_agg)
    spawn(2, _two, model_dir, out, loss_agg)
    single = torch.load(tmp_path / "single0.pt")
    ranks = [torch.load(out % r) for r in range(2)]
    for name, tensor in single["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name  # identical replicas
        # float sums in another order, amplified by Adam's normalisation where a gradient is near 0:
        # within 0.2% of one step (lr 1e-2)
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, rtol=0, atol=2e-5)
    for key in ("loss", "entropy", "grad_norm"):
        assert ranks[0]["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-6), key


# -- failures ---------------------------------------------------------------------------------

def test_a_failing_controller_brings_the_run_down_with_its_message(tmp_path):
    (tmp_path / "fails.py").write_text(
        "import os\n"
        "def score(prompt, response, answer):\n"
        "    if os.environ.get('LOCAL_RANK') == '1':\n"
        "        raise ValueError('controller one cannot score')\n"
        "    return 0.0\n"
    )
    result = _gcore("--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.collective_timeout", "60",
                    "--trainer.default_root_dir", str(tmp_path / "runs"),
                    "--reward", "python", "--reward.function", f"{tmp_path}/fails.py:score", timeout=240)
    assert result.returncode != 0
    assert "controller 1 failed: RewardError" in result.stderr and "controller one cannot score" in result.stderr
    assert "controller 0: controller 1 failed" in result.stderr  # the survivor names the failed controller



def test_two_nodes_on_loopback(tmp_path):
    port = str(free_port())
    args = [sys.executable, "-m", "gcore", "fit", *FAST, "--trainer.num_nodes", "2", "--trainer.devices", "1",
            "--trainer.accelerator", "cpu", "--trainer.collective_timeout", "120",
            "--trainer.default_root_dir", str(tmp_path / "runs"), "--data.prompts_per_step", "5"]
    nodes = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                              "NODE_RANK": str(node), "LOCAL_RANK": "0"})
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    rows = _metrics(tmp_path / "runs")  # written by node 0 only
    assert [r["step"] for r in rows] == ["0", "1"] and rows[0]["samples/total"] == "10.0"
