"""``sglang`` engine: SGLang's offline ``Engine`` (its scheduler runs in a child process).

Uses SGLang's own API: ``Engine.generate(input_ids=..., return_logprob=True)``,
``release_memory_occupation``/``resume_memory_occupation`` for co-location, and
``update_weights_from_tensor`` (CUDA IPC handles to the scheduler, no disk round trip) in buckets.
SGLang's kernels are GPU-only; on CPU machines only the translation below is exercised.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from gcore.engines.base import Engine, buckets
from gcore.errors import ConfigError, GcoreError
from gcore.types import Generation, SamplingParams

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _import_sglang():  # noqa: ANN202
    try:
        import sglang
    except Exception as err:  # ImportError, or sgl_kernel failing to load on a machine it does not support
        raise ConfigError(
            f"--engine sglang needs SGLang on a supported GPU ({type(err).__name__}: {err}): "
            "pip install 'gcore[sglang]'"
        ) from None
    return sglang


def sampling_dict(params: SamplingParams) -> dict[str, Any]:
    """SGLang's sampling parameters for one request (``n`` is handled by repeating the prompt)."""
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token in the output: the policy learns to stop
    }


def to_generation(output: dict[str, Any]) -> Generation:
    """gcore's ``Generation`` from one SGLang output dict (``meta_info`` with token logprobs).

    ``meta_info["output_token_logprobs"]`` holds one ``(logprob, token_id, text)`` per sampled
    token; its token ids are the response. ``finish_reason["type"]`` is ``stop`` (a stop token or
    string), ``length`` (cut at ``max_new_tokens``) or ``abort`` (an error, raised here).
    """
    meta = output.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise GcoreError(f"SGLang aborted a request: {reason.get('message', reason)}")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise GcoreError("SGLang returned no output_token_logprobs; requests must set return_logprob=True")
    token_ids = [int(entry[1]) for entry in entries]
    logprobs = [float(entry[0]) for entry in entries]
    if "output_ids" in output and list(output["output_ids"]) != token_ids:
        raise GcoreError(
            f"SGLang's output_ids ({len(output['output_ids'])} tokens) and its logprob token ids "
            f"({len(token_ids)}) disagree"
        )
    return Generation(token_ids, logprobs, finished=kind == "stop")


def group_outputs(outputs: Sequence[dict[str, Any]], num_prompts: int, n: int) -> list[list[Generation]]:
    """Regroup the flat outputs of ``num_prompts * n`` requests into ``n`` generations per prompt."""
    if len(outputs) != num_prompts * n:
        raise GcoreError(f"SGLang returned {len(outputs)} outputs for {num_prompts} prompts x {n} samples")
    flat = [to_generation(o) for o in outputs]
    return [flat[i * n : (i + 1) * n] for i in range(num_prompts)]


class SGLangEngine(Engine):
    """Generation with SGLang's offline engine.

    Args:
        mem_fraction_static: share of GPU memory for weights and KV cache.
        context_length: the KV cache's context length (default: the model's).
        sync_bucket_mb: weights go to SGLang in buckets of about this size.
        timeout_s: a generate, weight update or memory call that takes longer fails clearly.
        seed: SGLang's random seed (each controller adds its rank).
    """

    def __init__(self, mem_fraction_static: float = 0.4, context_length: int | None = None,
                 sync_bucket_mb: int = 512, timeout_s: float = 600.0, seed: int = 0) -> None:
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            _import_sglang()
        self.mem_fraction_static = mem_fraction_static
        self.context_length = context_length
        self.sync_bucket_mb = sync_bucket_mb
        self.timeout_s = timeout_s
        self.seed = seed
        self.engine = None
        self.asleep = False
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gcore-sglang")

    def _call(self, what: str, fn, *args, **kwargs):  # noqa: ANN001, ANN202
        future = self._calls.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise GcoreError(f"SGLang {what} did not finish within {self.timeout_s} s") from None

    def setup(self, model_path: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool) -> None:
        if device.type != "cuda":
            raise ConfigError("--engine sglang runs on CUDA GPUs only; use --engine hf or vllm on CPU")
        os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "false")  # logprobs after temperature
        sglang = _import_sglang()
        rank = int(os.environ.get("RANK", 0))
        self.engine = sglang.Engine(
            model_path=model_path,
            dtype=DTYPE_NAMES.get(dtype, "auto"),
            trust_remote_code=trust_remote_code,
            mem_fraction_static=self.mem_fraction_static,
            context_length=self.context_length,
            random_seed=self.seed + rank,
            base_gpu_id=device.index or 0,
            enable_memory_saver=True,
            skip_tokenizer_init=True,
            log_level="error",
        )

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        flat = [list(p) for p in prompts for _ in range(params.n)]
        outputs = self._call("generate", self.engine.generate, input_ids=flat,
                             sampling_params=sampling_dict(params), return_logprob=True)
        return group_outputs(outputs, len(prompts), params.n)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        received = 0
        pending = list(buckets(weights, self.sync_bucket_mb * 2**20))
        for i, bucket in enumerate(pending):
            received += sum(t.numel() * t.element_size() for _, t in bucket)
            self._call("weight update", self.engine.update_weights_from_tensor,
                       named_tensors=bucket, flush_cache=i == len(pending) - 1)
        return received

    def sleep(self) -> None:
        if self.engine is not None and not self.asleep:
            start = time.perf_counter()
            self._call("memory release", self.engine.release_memory_occupation)
            self.asleep, self.last_sleep_seconds = True, time.perf_counter() - start

    def wake_up(self) -> None:
        if self.engine is not None and self.asleep:
            self._call("memory resume", self.engine.resume_memory_occupation)
            self.asleep = False

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        self._calls.shutdown(wait=False)
