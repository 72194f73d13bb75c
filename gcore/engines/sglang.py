"""``sglang`` engine: SGLang's offline ``Engine`` (its scheduler runs in a child process).

Uses SGLang's own API: ``Engine.generate(input_ids=..., return_logprob=True)`` (each prompt
repeated ``n`` times), ``update_weights_from_tensor`` in buckets (tensors handed to the scheduler
process through shared memory, no disk round trip), and ``release_memory_occupation`` /
``resume_memory_occupation`` for co-location on GPUs.

On CPUs it runs SGLang 0.5.15.post1's CPU engine (``SGLANG_USE_CPU_ENGINE=1``), installed into an
environment of its own by ``scripts/install_sglang_cpu.sh`` (see docs/engines.md). There SGLang's
memory release frees nothing, so ``sleep`` shuts the engine's processes down and ``wake_up`` starts
them again from the checkpoint; the next weight sync brings the trainer's weights back.

Partial rollouts (``interrupt`` set by the worker): ``generate`` streams (``stream=True``: each request's tokens and
log-probabilities so far, one message per new token), asks ``interrupt`` after each message and, once it says True,
aborts the unfinished requests (SGLang's ``abort_request``) and returns each one's tokens so far (``finished``
False). The tokens SGLang made after the last message read are dropped with the aborted requests. A weight sync
flushes SGLang's prefix cache (``flush_cache`` on its last bucket): its entries hold keys and values of the old
weights, which a continued response (its prompt and tokens so far) would otherwise reuse.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from gcore.engines.base import (
    Engine,
    EngineCapabilities,
    Visual,
    buckets,
    checkpoint_generation_config,
    warn_ignored_generation_values,
)
from gcore.errors import ConfigError, GcoreError
from gcore.model import ModelSource
from gcore.types import Generation, SamplingParams

if TYPE_CHECKING:
    import psutil

T = TypeVar("T")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
CPU_RELEASE = ("restart", "resident")
log = logging.getLogger(__name__)


def _import_sglang() -> ModuleType:
    try:
        import sglang
    # ImportError; RuntimeError from torchvision next to a CPU torch; OSError from sgl_kernel on an unsupported GPU
    except Exception as err:  # noqa: BLE001
        raise ConfigError(
            f"--engine sglang needs SGLang ({type(err).__name__}: {err}): on GPUs pip install 'gcore[sglang]'; "
            "on CPUs run scripts/install_sglang_cpu.sh VENV (an environment of its own, see docs/engines.md)"
        ) from None
    return sglang


def _architecture_override(model_path: str) -> str | None:
    """SGLang picks the model class from ``architectures`` in config.json; name it when the file does not."""
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        config = json.load(f)
    if config.get("architectures"):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
    if architecture is None:
        raise ConfigError(f"{config_file}: no 'architectures' and no causal LM known for model_type "
                          f"{config.get('model_type')!r}; SGLang cannot pick the model class")
    return json.dumps({"architectures": [architecture]})


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
    """Generation with SGLang's offline engine (GPU, or CPU with SGLang 0.5.15.post1: see docs/engines.md).

    Args:
        mem_fraction_static: GPU: share of GPU memory for weights and KV cache.
        context_length: the KV cache's context length (default: the model's).
        sync_bucket_mb: weights go to SGLang in buckets of at most this many MiB (a larger tensor goes alone).
        timeout_s: a generate, weight update or memory call that takes longer fails clearly.
        seed: SGLang's random seed (each controller adds its rank).
        cpu_kv_cache_tokens: CPU: how many tokens the KV cache holds (SGLang's ``max_total_tokens``).
        cpu_threads: CPU: OpenMP threads of SGLang's scheduler process (default: this process's
            ``OMP_NUM_THREADS``, else one per core). On a machine shared with other work, 1 avoids
            OpenMP spin-waiting against the neighbours (see BENCHMARKS.md).
        cpu_release: CPU: what ``sleep`` does, since SGLang's memory release frees nothing there:
            ``restart`` ends the engine's processes (their memory is freed) and ``wake_up`` starts them
            again from the checkpoint (the next weight sync restores the trainer's weights);
            ``resident`` keeps them running (nothing is freed, nothing is paid).
        joint_top_k_top_p: accept SGLang's top-k with top-p: it keeps the tokens within both the top-k and the
            nucleus of the whole distribution, where ``model.generate`` (and the hf and vllm engines) take the
            nucleus of the top-k's mass, renormalised, which keeps fewer. Off (the default), sampling with both
            ``--sampling.top_k`` and ``--sampling.top_p < 1`` is refused (greedy decoding is not); either alone
            samples as ``generate`` does (docs/engines.md, "Sampling").

    Sampling is ``SamplingParams`` alone, as with the ``hf`` engine: SGLang applies the sampling values of a
    checkpoint's ``generation_config.json`` only as its OpenAI server's defaults, never to ``Engine.generate``; it
    takes the file's and config.json's EOS ids as stop tokens. ``setup`` logs a warning naming the values
    ``model.generate`` would have applied (docs/engines.md, "Sampling").
    """

    def __init__(self, mem_fraction_static: float = 0.4, context_length: int | None = None,
                 sync_bucket_mb: float = 512.0, timeout_s: float = 600.0, seed: int = 0,
                 cpu_kv_cache_tokens: int = 16384, cpu_threads: int | None = None,
                 cpu_release: str = "restart", joint_top_k_top_p: bool = False) -> None:
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            _import_sglang()  # raises the "install it" error before any work starts
        if sync_bucket_mb <= 0:
            raise ConfigError("--engine.sync_bucket_mb must be positive")
        if cpu_release not in CPU_RELEASE:
            raise ConfigError(f"--engine.cpu_release must be one of {', '.join(CPU_RELEASE)}, not {cpu_release!r}")
        if cpu_threads is not None and cpu_threads < 1:
            raise ConfigError("--engine.cpu_threads must be at least 1")
        self.mem_fraction_static = mem_fraction_static
        self.context_length = context_length
        self.sync_bucket_mb = sync_bucket_mb
        self.timeout_s = timeout_s
        self.seed = seed
        self.cpu_kv_cache_tokens = cpu_kv_cache_tokens
        self.cpu_threads = cpu_threads
        self.cpu_release = cpu_release
        self.joint_top_k_top_p = joint_top_k_top_p
        self.engine: Any = None  # sglang.Engine once set up
        self.processes: list = []  # psutil.Process of every process SGLang started for this engine
        self.device = torch.device("cpu")
        self.asleep = False
        self.stale = False  # restarted from the checkpoint after a weight sync: generate needs a sync first
        self.synced = False
        self.last_sync_seconds = self.last_start_seconds = self.last_sleep_seconds = self.last_wake_seconds = 0.0
        self._launch: dict[str, Any] = {}
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gcore-sglang")

    #: SGLang streams each request's tokens here: ``generate`` stops when ``interrupt`` says so. Its scheduler and
    #: detokenizer run in processes of its own: an engine worker that holds it is started non-daemonic (a daemonic
    #: process cannot have children). Image prompts are not wired (``generate`` refuses them)
    capabilities = EngineCapabilities(interrupt=True, starts_processes=True)

    def __getstate__(self) -> dict[str, Any]:
        """The configuration only (what an engine worker gets, ``--placement.workers``): the worker sets it up
        there and starts SGLang's processes itself. The call thread and a running engine do not travel."""
        if self.engine is not None:
            raise TypeError("a set-up SGLangEngine cannot be sent to another process (its SGLang processes "
                            "belong to this one); send it before setup")
        return {k: v for k, v in self.__dict__.items() if k != "_calls"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gcore-sglang")

    def _call(self, what: str, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``fn(*args, **kwargs)`` on the call thread, under the timeout; fails early if an SGLang process died."""
        future = self._calls.submit(fn, *args, **kwargs)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return future.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except FutureTimeout:
                dead = [p.pid for p in self.processes if not _alive(p)]
                if dead:
                    raise GcoreError(f"SGLang {what} failed: SGLang processes {dead} died; "
                                     "its log above says why") from None
                if time.monotonic() >= deadline:
                    raise GcoreError(f"SGLang {what} did not finish within {self.timeout_s} s "
                                     "(--engine.timeout_s)") from None

    def setup(self, source: ModelSource, device: torch.device) -> None:
        if device.type not in ("cuda", "cpu"):
            raise ConfigError(f"--engine sglang runs on CUDA GPUs or CPUs, not {device.type}")
        self.device = device
        warn_ignored_generation_values(log, source.path, checkpoint_generation_config(source.path), "sglang")
        rank = int(os.environ.get("RANK", "0"))
        kwargs: dict[str, Any] = {
            "model_path": source.path,
            "dtype": DTYPE_NAMES.get(source.dtype, "auto"),
            "trust_remote_code": source.trust_remote_code,
            "context_length": self.context_length,
            "random_seed": self.seed + rank,
            "skip_tokenizer_init": True,
            "log_level": "error",
        }
        override = _architecture_override(source.path)
        if override is not None:
            kwargs["json_model_override_args"] = override
        if device.type == "cuda":
            kwargs.update(mem_fraction_static=self.mem_fraction_static, base_gpu_id=device.index or 0,
                          enable_memory_saver=True)
        else:
            # SGLang's CPU engine; without AMX it falls back to torch-native attention (no kernel to build)
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
            kwargs.update(device="cpu", tp_size=1, disable_overlap_schedule=True,
                          max_total_tokens=self.cpu_kv_cache_tokens)
        os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "false")  # logprobs after temperature
        self._launch = kwargs
        self._start()

    def _start(self) -> None:
        """Start SGLang's engine (its scheduler and detokenizer processes) with the arguments from ``setup``."""
        import psutil

        sglang = _import_sglang()
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        threads = os.environ.get("OMP_NUM_THREADS")
        if self.device.type == "cpu" and self.cpu_threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(self.cpu_threads)  # SGLang's processes inherit it
        start = time.perf_counter()
        failure = None
        # SGLang's start reconfigures this process's root logger (basicConfig(force=True) at --log_level error),
        # which would silence every later gcore warning in the run: its level and handlers are put back
        root = logging.getLogger()
        root_level, root_handlers = root.level, root.handlers[:]
        try:
            self.engine = sglang.Engine(**self._launch)
        except Exception as err:  # noqa: BLE001 - any start-up failure: its processes are ended below
            failure = err
        finally:
            root.handlers[:] = root_handlers
            root.setLevel(root_level)
            if threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = threads
            self.processes = [p for p in me.children(recursive=True) if p.pid not in before
                              and p.pid != _resource_tracker_pid()]
        if failure is not None:
            self._stop()  # whatever SGLang had started before it failed
            raise GcoreError(f"SGLang could not start on {self._launch['model_path']}: "
                             f"{type(failure).__name__}: {failure}") from failure
        self.last_start_seconds = time.perf_counter() - start
        log.info("SGLang started in %.1f s (%d processes)", self.last_start_seconds, len(self.processes))

    def _stop(self) -> None:
        """End the engine's processes, and only those.

        Not ``Engine.shutdown()``: it kills every child process of the calling process, which in
        gcore may be other ranks or placement workers.
        """
        import psutil

        engine, self.engine = self.engine, None
        watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it would SIGQUIT this process on seeing the scheduler exit
        alive = [p for p in self.processes if p.is_running()]
        for process in alive:
            process.terminate()
        _, alive = psutil.wait_procs(alive, timeout=30)
        for process in alive:
            process.kill()
        psutil.wait_procs(alive, timeout=30)
        self.processes = []
        loop = getattr(engine, "loop", None)  # each Engine makes its own event loop
        if loop is not None and not loop.is_closed() and not loop.is_running():
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()  # its tokenizer manager's receive loops, waiting on the ended processes
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 visual: Visual | None = None) -> list[list[Generation]]:
        self.refuse_images(visual)
        if self.engine is None:
            raise GcoreError("SGLangEngine.generate called before setup, after shutdown or while asleep")
        if self.stale:
            raise GcoreError("SGLang restarted from the checkpoint after sleep: sync the weights before generating")
        if params.temperature > 0 and params.top_k > 0 and params.top_p < 1.0 and not self.joint_top_k_top_p:
            raise ConfigError(f"--sampling.top_k {params.top_k} with --sampling.top_p {params.top_p}: SGLang keeps "
                              "the top-k tokens within the nucleus of the whole distribution, not the nucleus of the "
                              "top-k's mass as model.generate and the hf and vllm engines do (more tokens kept); "
                              "--engine.joint_top_k_top_p true accepts SGLang's rule (docs/engines.md, \"Sampling\")")
        flat = [list(p) for p in prompts for _ in range(params.n)]
        if self.interrupt is not None:
            outputs = self._call("generate", self._generate_interruptible, flat, sampling_dict(params), self.interrupt)
        else:
            outputs = self._call("generate", self.engine.generate, input_ids=flat,
                                 sampling_params=sampling_dict(params), return_logprob=True)
        return group_outputs(outputs, len(prompts), params.n)

    def _generate_interruptible(self, flat: list[list[int]], sampling: dict[str, Any],
                                interrupt: Callable[[], bool]) -> list[dict[str, Any]]:
        """``Engine.generate`` streamed (each request's output so far, one message per new token, ``index`` its
        position), asking ``interrupt`` after each message; once it says True the unfinished requests are aborted
        and each one's output is its last message read (tokens so far, no finish reason: ``finished`` False). The
        stream is then read to its end (each aborted request's last message), which leaves nothing in SGLang."""
        asyncio.set_event_loop(self.engine.loop)  # abort_request's socket sends on this thread's current loop
        rids = [uuid.uuid4().hex for _ in flat]  # named here, to abort them
        last: list[dict[str, Any]] = [{"output_ids": [], "meta_info": {"output_token_logprobs": []}} for _ in flat]
        running = set(range(len(flat)))
        stream = self.engine.generate(input_ids=flat, sampling_params=sampling, return_logprob=True, stream=True,
                                      rid=rids)
        try:
            for chunk in stream:
                if not running:  # cut: what comes now is the aborted requests' ends
                    continue
                i, meta = chunk["index"], chunk["meta_info"]
                # copies: SGLang keeps extending the lists of an unfinished request's messages
                last[i] = {"output_ids": list(chunk["output_ids"]),
                           "meta_info": {"finish_reason": meta["finish_reason"],
                                         "output_token_logprobs": list(meta["output_token_logprobs"])}}
                if meta["finish_reason"] is not None:
                    running.discard(i)
                if running and interrupt():  # a weight update came: stop here
                    self._abort(rids[j] for j in running)
                    running.clear()
        except BaseException:
            self._abort(rids[j] for j in running)
            raise
        return last

    def _abort(self, rids: Iterable[str]) -> None:
        """Abort SGLang requests by id (one that has finished meanwhile is left alone)."""
        for rid in rids:
            self.engine.tokenizer_manager.abort_request(rid)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.engine is None:
            raise GcoreError("SGLangEngine.update_weights called before setup, after shutdown or while asleep")
        start, received, count = time.perf_counter(), 0, 0
        pending = list(buckets(weights, int(self.sync_bucket_mb * 2**20)))
        for i, bucket in enumerate(pending):
            received += sum(t.numel() * t.element_size() for _, t in bucket)
            # SGLang hands the tensors over with torch's shared-memory pickling, which cannot share a storage mapped
            # from a file (an engine worker's view of the pool's weights in /dev/shm: "Bad file descriptor"); a copy
            bucket = [(name, t.clone() if t.untyped_storage().filename is not None else t) for name, t in bucket]
            result = self._call(f"weight update (bucket {i + 1} of {len(pending)})",
                                self.engine.update_weights_from_tensor,
                                named_tensors=bucket, flush_cache=i == len(pending) - 1)
            ok, message = result[0], result[1] if len(result) > 1 else ""
            if not ok:
                raise GcoreError(f"SGLang refused weight bucket {i + 1} of {len(pending)}: {message}")
            count += 1
        self.last_sync_seconds = time.perf_counter() - start
        self.last_sync_buckets = count
        self.stale, self.synced = False, True
        log.info("SGLang weight sync: %.4f GB in %d buckets, %.3f s, %.2f GB/s", received / 1e9, count,
                 self.last_sync_seconds, received / 1e9 / max(self.last_sync_seconds, 1e-9))
        return received

    def sleep(self) -> None:
        if self.engine is None or self.asleep:
            return
        start = time.perf_counter()
        if self.device.type == "cuda":
            self._call("memory release", self.engine.release_memory_occupation)
        elif self.cpu_release == "restart":
            self._stop()
        else:
            return  # resident: nothing to release
        self.asleep, self.last_sleep_seconds = True, time.perf_counter() - start

    def wake_up(self) -> None:
        if not self.asleep:
            return
        start = time.perf_counter()
        if self.device.type == "cuda":
            self._call("memory resume", self.engine.resume_memory_occupation)
        else:
            self._start()  # from the checkpoint: the trainer's weights come with the next sync
            self.stale = self.synced
        self.asleep, self.last_wake_seconds = False, time.perf_counter() - start

    def shutdown(self) -> None:
        self._stop()
        self.asleep = False
        self._calls.shutdown(wait=False)


def _alive(process: psutil.Process) -> bool:
    """Whether a ``psutil.Process`` is running (a zombie is not)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _resource_tracker_pid() -> int | None:
    """Python's multiprocessing resource tracker: started by SGLang's first spawn, shared by the whole process."""
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)
