"""The megatron backend on a mixture of experts (the embedded tiny Qwen3-MoE): the HF <-> megatron expert layout,
expert parallelism (``--backend.expert_parallel_size``) against the torch backend, checkpoints across EP sizes, and
the combinations it refuses in one line (docs/moe.md, "Megatron expert parallelism").

Tolerances are test_megatron.py's (float32, CPU): log-probabilities within 1e-5, and after one AdamW step (lr 1e-2)
on the same batches the loss within 1e-5, the gradient norm within 1e-4 and every weight within 1e-4 of the torch
backend's.
"""

import os

import pytest
import torch
from conftest import spawn
from lightning_fabric import Fabric
from test_megatron import LOGPROB_TOL, LOSS_TOL, WEIGHT_TOL, _checkpoint_manager, _rank_batch

from gcore import GRPO, ModelConfig, TorchBackend
from gcore.backends.megatron.convert import hf_state_to_megatron, layout_from_hf, megatron_states_to_hf
from gcore.errors import ConfigError
from gcore.model import ModelSource, char_tokenizer, materialize
from gcore.testing import set_up

#: the embedded tiny MoE model: 2 layers of 4 experts (width 16), 2 per token
MOE = dict(architecture="qwen3_moe", num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=16)


def _megatron():
    pytest.importorskip("megatron.core")
    from gcore.backends.megatron import MegatronBackend

    return MegatronBackend


def _moe_dir(root):
    return materialize(ModelConfig(**MOE), char_tokenizer(), 0, os.path.join(root, "model"))


def _moe_config(norm_topk_prob=True):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, norm_topk_prob=norm_topk_prob, tie_word_embeddings=True)


def test_expert_layout_round_trips_exactly():
    """HF's fused experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), router ``gate`` and q/k norms to
    megatron's per-expert ``linear_fc1``/``linear_fc2``, ``router`` and ``q/k_layernorm`` and back, bit for bit."""
    from transformers import AutoModelForCausalLM

    config = _moe_config()
    torch.manual_seed(0)
    hf = {k: torch.randn_like(v) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    layout = layout_from_hf(config, 1)
    assert (layout.num_experts, layout.moe_ffn_size, layout.moe_top_k, layout.qk_norm) == (4, 16, 2, True)
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    for i in range(2):
        names += [f"decoder.layers.{i}.{n}" for n in (
            "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight",
            "mlp.router.weight")]
        names += [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_{fc}.weight"
                  for e in range(4) for fc in ("fc1", "fc2")]
    megatron = hf_state_to_megatron(hf, names, layout, 1, 0)
    fc1 = megatron["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert torch.equal(fc1, hf["model.layers.1.mlp.experts.gate_up_proj"][2])  # [gate; up] rows, as HF chunks them
    assert torch.equal(megatron["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    back = megatron_states_to_hf([megatron], layout)
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key
    with pytest.raises(KeyError, match="expert 3 missing"):
        megatron_states_to_hf([{k: v for k, v in megatron.items() if "local_experts.3." not in k}], layout)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_logprobs_match_the_hf_model(tmp_path, norm_topk_prob):
    """One process (EP=1): megatron's MoELayer (router, all-gather dispatcher, SequentialMLP) gives HF Qwen3-MoE's
    log-probabilities, with the top-k weights renormalised or not, and its weights back unchanged."""
    backend_class = _megatron()
    from transformers import AutoModelForCausalLM

    from gcore.backends import token_logprobs

    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(_moe_config(norm_topk_prob))
    hf.save_pretrained(tmp_path / "model")
    backend = backend_class()
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(str(tmp_path / "model")), GRPO(kl_coef=0.0),
                  embedded=True)
    assert backend.dispatcher == "allgather"
    ids = torch.randint(4, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    ours, _ = backend.forward.logprobs(backend.policy, ids, 1.0)
    theirs, _ = token_logprobs(hf(input_ids=ids).logits, ids, 1.0)
    assert (ours - theirs).abs().max() < LOGPROB_TOL
    weights = dict(backend.named_weights())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(weights[name], tensor), name


def _train_and_save(fabric, model_dir, root):
    """Rank-local batches of 4 and 3 rows (micro-batches of 3: 2 forwards and 1, the expert-parallel exchange must
    still pair them): the torch backend's step, then megatron's at EP=1 (DP=2, distributed optimizer) and at EP=2;
    the EP=2 run saves a checkpoint and exports the HF model."""
    from gcore.backends.megatron import MegatronBackend

    rank = fabric.global_rank
    batch = _rank_batch(rank)
    torch_backend = TorchBackend(lr=1e-2, micro_batch_size=2)
    torch_backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    results = {"torch": {"logprobs": torch_backend.compute_logprobs(batch, "policy"),
                         "metrics": torch_backend.train(batch, set_up(GRPO(kl_coef=0.0), 8)),
                         "weights": dict(torch_backend.named_weights())}}
    for ep in (1, 2):
        backend = MegatronBackend(expert_parallel_size=ep, lr=1e-2, micro_batch_size=3)
        backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
        local = [n for n, _ in backend.policy.named_parameters() if "layers.0.mlp.experts" in n]
        results[ep] = {"logprobs": backend.compute_logprobs(batch, "policy"),
                       "metrics": backend.train(batch, set_up(GRPO(kl_coef=0.0), 8)),
                       "weights": dict(backend.named_weights()), "local_experts": len(local) // 2,
                       "placeholders": backend.forward.placeholder_forwards,
                       "optimizer": type(backend.optimizer.optimizer).__name__}
    manager = _checkpoint_manager(fabric, os.path.join(root, "ckpt"))
    manager.save(1, backend.state_dict(), {"step": 1}, {"rank": rank})
    manager.wait()
    if rank == 0:
        backend.save_pretrained(os.path.join(root, "export"))
        results["moments"] = backend.state_dict()["optim"]
    else:
        backend.state_dict()  # (the gathers are collectives)
    # a mini-batch with no rows on rank 1: it still joins rank 0's expert exchanges (or rank 0 would hang), and its
    # experts get the gradient of rank 0's tokens routed to them
    rows = torch.arange(len(batch)) if rank == 0 else torch.arange(0)
    metrics = backend.train_mini_batch(batch, rows, set_up(GRPO(kl_coef=0.0), 8))
    grads = [p.grad for n, p in backend.policy.named_parameters() if "mlp.experts" in n and p.grad is not None]
    results["no_rows"] = {"loss": metrics["loss"], "expert_grad": max(float(g.abs().max()) for g in grads),
                          "placeholders": backend.forward.placeholder_forwards}
    torch.save(results, os.path.join(root, f"result.{rank}"))


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    _megatron()
    root = str(tmp_path_factory.mktemp("ep"))
    model_dir = _moe_dir(root)
    with pytest.MonkeyPatch.context() as patch:  # (conftest's fresh launch environment is per test, this per module)
        for key in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
            patch.delenv(key, raising=False)
        spawn(2, _train_and_save, model_dir, root)
    return root, model_dir, [torch.load(os.path.join(root, f"result.{rank}")) for rank in range(2)]


@pytest.mark.integration
@pytest.mark.slow
def test_expert_parallel_step_matches_the_torch_backend(ep_run):
    """EP=2 on two gloo ranks (each holding 2 of the 4 experts of every layer; the dense layers data parallel): the
    torch backend's log-probabilities, loss, gradient norm and updated weights, and megatron's at EP=1."""
    _, _, ranks = ep_run
    for rank, result in enumerate(ranks):
        reference = result["torch"]
        assert result[2]["local_experts"] == 2 and result[1]["local_experts"] == 4
        assert result[2]["optimizer"] == "AdamW" and result[1]["optimizer"] == "ChainedOptimizer"
        # rank 1 has one micro-batch, rank 0 two: rank 1 ran a pad-token forward to join rank 0's exchanges, in
        # compute_logprobs and in train
        assert result[2]["placeholders"] == 2 * rank and result[1]["placeholders"] == 0
        for ep in (1, 2):
            run = result[ep]
            assert (run["logprobs"] - reference["logprobs"]).abs().max() < LOGPROB_TOL, (rank, ep)
            assert abs(run["metrics"]["loss"] - reference["metrics"]["loss"]) < LOSS_TOL, (rank, ep)
            assert abs(run["metrics"]["grad_norm"] - reference["metrics"]["grad_norm"]) < 1e-4, (rank, ep)
            assert sorted(run["weights"]) == sorted(reference["weights"])
            for name, tensor in reference["weights"].items():
                assert (run["weights"][name] - tensor).abs().max() < WEIGHT_TOL, (rank, ep, name)


@pytest.mark.integration
@pytest.mark.slow
def test_a_rank_without_rows_joins_the_expert_exchanges(ep_run):
    _, _, ranks = ep_run
    # rank 0's 4 rows are 2 micro-batches (of 3 and 1): rank 1 ran 2 pad-token forwards
    assert ranks[1]["no_rows"]["placeholders"] == ranks[1][2]["placeholders"] + 2
    assert ranks[0]["no_rows"]["placeholders"] == 0
    assert ranks[0]["no_rows"]["loss"] == ranks[1]["no_rows"]["loss"]  # the global metric, on both ranks
    assert ranks[1]["no_rows"]["expert_grad"] > 0  # rank 0's tokens reached rank 1's experts


@pytest.mark.integration
@pytest.mark.slow
def test_expert_parallel_export_is_the_trained_hf_model(ep_run):
    from transformers import AutoModelForCausalLM

    root, model_dir, ranks = ep_run
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(root, "export")).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    weights = ranks[0][2]["weights"]
    assert sorted(exported) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(exported[name], tensor), name
    # the update reached the experts of both expert-parallel ranks (experts 0-1 on rank 0, 2-3 on rank 1)
    step = (weights["model.layers.0.mlp.experts.down_proj"] - initial["model.layers.0.mlp.experts.down_proj"]).abs()
    assert step[:2].max() > 1e-3 and step[2:].max() > 1e-3


@pytest.mark.integration
@pytest.mark.slow
def test_checkpoint_saved_at_ep2_loads_at_ep1(ep_run):
    backend_class = _megatron()
    from gcore.checkpoint import latest_checkpoint

    root, model_dir, ranks = ep_run
    fabric = Fabric(accelerator="cpu", devices=1)
    backend = backend_class(lr=1e-2)
    backend.setup(fabric, ModelSource(model_dir), GRPO(kl_coef=0.0), embedded=True)
    state = backend.state_dict()
    ckpt = os.path.join(root, "ckpt")
    trainer_state, _ = _checkpoint_manager(fabric, ckpt).load(latest_checkpoint(ckpt), state)
    backend.load_state_dict(state)
    assert trainer_state["step"] == 1
    for name, tensor in backend.named_weights():
        assert torch.equal(tensor, ranks[0][2]["weights"][name]), name
    reloaded = backend.state_dict()["optim"]
    for key in ("exp_avg", "exp_avg_sq"):
        for name, tensor in ranks[0]["moments"][key].items():
            assert torch.equal(reloaded[key][name], tensor), (key, name)
    assert reloaded["exp_avg"]["model.layers.1.mlp.experts.gate_up_proj"][3].abs().max() > 0  # rank 1's expert
    backend.train(_rank_batch(0), set_up(GRPO(kl_coef=0.0), 8))  # training goes on from there


def test_expert_parallel_refusals_are_one_line(tmp_path):
    backend_class = _megatron()
    from transformers import AutoConfig

    for kwargs, message in (
        ({"pipeline_parallel_size": 2}, "expert_parallel_size 2 with --backend.pipeline_parallel_size 2: the megatron "
                                        "backend's expert parallelism runs without pipeline parallelism"),
        ({"sequence_parallel_size": 2}, "expert_parallel_size 2 with --backend.sequence_parallel_size 2"),
        ({"distributed_optimizer": True}, "expert_parallel_size 2 with --backend.distributed_optimizer true"),
    ):
        with pytest.raises(ConfigError, match=message):
            backend_class(expert_parallel_size=2, **kwargs)
    with pytest.raises(ConfigError, match="expert_parallel_size must be >= 1, got 0"):
        backend_class(expert_parallel_size=0)
    moe = AutoConfig.from_pretrained(_moe_dir(str(tmp_path)))
    dense_model = ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    dense = AutoConfig.from_pretrained(materialize(dense_model, char_tokenizer(), 0, str(tmp_path / "dense")))
    for kwargs, config, message in (
        ({"expert_parallel_size": 2}, dense, "expert_parallel_size 2 needs a mixture-of-experts model"),
        ({"expert_parallel_size": 3}, moe, "expert_parallel_size 3 does not divide the model's 4 experts"),
        ({"tensor_parallel_size": 2}, moe, "tensor_parallel_size 2 with a mixture-of-experts model: megatron-core "
                                           "0.16 trains MoE layers under tensor parallelism only with its sequence "
                                           "parallelism"),
        ({"sequence_parallel_size": 2}, moe, "sequence_parallel_size 2 with a mixture-of-experts model"),
    ):
        backend = backend_class(**kwargs)
        backend.hf_config = config
        with pytest.raises(ConfigError, match=message):
            backend._check_experts(layout_from_hf(config, 1))
    from gcore import Trainer, TrainerConfig

    with pytest.raises(ConfigError, match=r"expert_parallel_size 2 does not divide the number of ranks \(1\)"):
        Trainer(trainer=TrainerConfig(devices=1), backend=backend_class(expert_parallel_size=2))
