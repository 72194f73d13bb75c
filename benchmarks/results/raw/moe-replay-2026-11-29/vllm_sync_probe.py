"""Which MoE weights does vLLM's sync leave stale? Train one step, then sync, then compare vLLM's params by name."""
import sys

sys.path.insert(0, "/work/main/tests")
import torch
from conftest import engine_logprob_gap
from lightning_fabric import Fabric

import gcore.engines.vllm as gv
from gcore import GRPO, ModelConfig, SamplingParams, TorchBackend
from gcore.algorithms.base import group_normalize
from gcore.engines.vllm import VLLMEngine
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import set_up

gv._experts = lambda path: 0  # the probe bypasses the refusal
tok = char_tokenizer()
path = materialize(ModelConfig(num_hidden_layers=2, architecture="qwen3_moe"), tok, 0, "/tmp/moeprobe/model")
fabric = Fabric(accelerator="cpu", devices=1)
backend = TorchBackend(lr=1e-2)
backend.setup(fabric, ModelSource(path), GRPO(), embedded=True)
engine = VLLMEngine(enforce_eager=True, max_model_len=256)
engine.setup(ModelSource(path), fabric.device)
params = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, stop_token_ids=(tok.eos_token_id,))
gap0, batch = engine_logprob_gap(engine, backend, tok, params)
batch.rewards = torch.arange(len(batch), dtype=torch.float) % 3
batch.advantages = group_normalize(batch.rewards, batch.group_ids, scale=True)
before = {k: v.detach().clone() for k, v in backend.named_weights()}
backend.train(batch, set_up(GRPO(kl_coef=0.0), params.max_new_tokens))
after = dict(backend.named_weights())
changed = {k for k in after if not torch.equal(after[k], before[k])}
print("GAP0", gap0, "changed tensors:", len(changed), sorted(changed)[:40], flush=True)
engine.update_weights(backend.named_weights())
gap1, _ = engine_logprob_gap(engine, backend, tok, params)
print("GAP1", gap1, flush=True)
model = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
for name, p in model.named_parameters():
    print("VLLM", name, tuple(p.shape), float(p.float().abs().sum()))
for k in sorted(after):
    print("HF", k, tuple(after[k].shape), float(after[k].float().abs().sum()), float(before[k].float().abs().sum()))
