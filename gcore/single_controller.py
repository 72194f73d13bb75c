"""The one-controller baseline (``--trainer.controllers 1``): rank 0 drives every rank.

This is the design G-Core replaces, kept so that the parallel controllers can be measured against
it. Rank 0 takes the whole batch of prompts, sends each rank its part for generation and collects
the completions, scores every sample itself, prepares the whole batch, and sends each rank its rows
for training; every rank still holds an engine and a shard of the training backend, and the
gradient all-reduce is the same as with parallel controllers. All rollout data, and any feature a
sample carries (``RolloutBatch.features``), passes through rank 0.

Data moves as tensors over the process group (``torch.distributed`` send/recv: a header of dtypes
and shapes, then the tensors); nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields

import torch
import torch.distributed as dist

from gcore.controller import Controller, StepRecord
from gcore.engines.base import Engine, Visual
from gcore.model import ModelSource
from gcore.types import Generation, Prompt, RolloutBatch, Sample, SamplingParams

_DTYPES = (torch.int64, torch.float32, torch.float64, torch.bool, torch.int32, torch.uint8, torch.float16,
           torch.bfloat16)
GENERATE, DONE = 1, 2


def send_tensors(tensors: Sequence[torch.Tensor], dst: int) -> int:
    """Send CPU tensors to rank ``dst`` (a header of dtypes and shapes, then each tensor); returns bytes."""
    header = [len(tensors)]
    for t in tensors:
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    dist.send(torch.tensor([len(header)], dtype=torch.int64), dst)
    dist.send(torch.tensor(header, dtype=torch.int64), dst)
    sent = 0
    for t in tensors:
        if t.numel():
            payload = t.contiguous().to(torch.uint8) if t.dtype == torch.bool else t.contiguous()
            dist.send(payload, dst)
            sent += payload.numel() * payload.element_size()
    return sent


def recv_tensors(src: int) -> list[torch.Tensor]:
    """Receive what ``send_tensors`` sent from rank ``src``."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    header = torch.zeros(int(size), dtype=torch.int64)
    dist.recv(header, src)
    values, pos, out = header.tolist(), 1, []
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        shape = values[pos + 2 : pos + 2 + ndim]
        pos += 2 + ndim
        wire = torch.uint8 if dtype == torch.bool else dtype
        t = torch.empty(shape, dtype=wire)
        if t.numel():
            dist.recv(t, src)
        out.append(t.bool() if dtype == torch.bool else t)
    return out


# what travels between the controller and the ranks ------------------------------------------------

def _encode_prompts(prompts: Sequence[Sequence[int]], features: torch.Tensor | None) -> list[torch.Tensor]:
    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    return [torch.tensor([GENERATE]), flat, lengths, features if features is not None else torch.empty(0)]


def _decode_prompts(message: list[torch.Tensor]) -> tuple[list[list[int]], torch.Tensor | None]:
    _, flat, lengths, features = message
    prompts = [p.tolist() for p in flat.split(lengths.tolist())] if len(lengths) else []
    return prompts, (features if features.dim() > 1 else None)


def _encode_generations(outputs: list[list[Generation]]) -> list[torch.Tensor]:
    flat = [g for group in outputs for g in group]
    return [
        torch.tensor([t for g in flat for t in g.token_ids], dtype=torch.int64),
        torch.tensor([x for g in flat for x in g.logprobs], dtype=torch.float32),
        torch.tensor([len(g.token_ids) for g in flat], dtype=torch.int64),
        torch.tensor([g.finished for g in flat], dtype=torch.bool),
    ]


def _decode_generations(message: list[torch.Tensor], n: int) -> list[list[Generation]]:
    ids, logprobs, lengths, finished = message
    sizes = lengths.tolist()
    flat = [Generation(t.tolist(), lp.tolist(), bool(f))
            for t, lp, f in zip(ids.split(sizes), logprobs.split(sizes), finished, strict=False)]
    return [flat[i : i + n] for i in range(0, len(flat), n)]


#: the one-controller baseline runs the synchronous step only (``--trainer.max_staleness`` 0): no
#: behaviour log-probabilities or policy versions travel
_BATCH_FIELDS = [f.name for f in fields(RolloutBatch)
                 if f.name not in ("temperature", "behaviour_logprobs", "policy_versions", "logprob_gaps")]


def _encode_batch(batch: RolloutBatch) -> list[torch.Tensor]:
    """A batch as tensors: which optional fields are set, the temperature, then the set fields."""
    present = [getattr(batch, name) is not None for name in _BATCH_FIELDS]
    out = [torch.tensor(present, dtype=torch.bool), torch.tensor([batch.temperature], dtype=torch.float64)]
    return out + [getattr(batch, name) for name, on in zip(_BATCH_FIELDS, present, strict=False) if on]


def _decode_batch(message: list[torch.Tensor]) -> RolloutBatch:
    present, temperature, *values = message
    tensors = iter(values)
    kwargs = {name: (next(tensors) if on else None) for name, on in zip(_BATCH_FIELDS, present.tolist(), strict=False)}
    return RolloutBatch(temperature=float(temperature), **kwargs)  # type: ignore[arg-type]  # the required ones are set


def _rows(batch: RolloutBatch, index: torch.Tensor) -> RolloutBatch:
    """Rows of a batch at its full width (so parts concatenate back without re-padding)."""
    out = {f.name: getattr(batch, f.name) for f in fields(batch)}
    for name, value in out.items():
        if isinstance(value, torch.Tensor):
            out[name] = value[index]
    return RolloutBatch(**out)


def _generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
    return engine.generate(prompts, params) if prompts else []


class RemoteEngines(Engine):
    """The controller's view of every rank's engine: ``generate`` splits the prompts over the ranks,
    sends each its part (and the prompts' features), runs its own part locally, and collects the
    completions. Weight updates stay local: every rank syncs its own engine from its own shard."""

    def __init__(self, local: Engine, world_size: int) -> None:
        self.local, self.world_size = local, world_size
        self.features: torch.Tensor | None = None  # of the prompts of the next ``generate`` call
        self.sent_bytes = 0

    def setup(self, source: ModelSource, device: torch.device) -> None:
        self.local.setup(source, device)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 visual: Visual | None = None) -> list[list[Generation]]:
        self.refuse_images(visual)  # the prompts travel as token tensors, without their images
        parts = torch.arange(len(prompts)).tensor_split(self.world_size)
        for rank in range(1, self.world_size):
            index = parts[rank].tolist()
            features = self.features[parts[rank]] if self.features is not None else None
            self.sent_bytes += send_tensors(_encode_prompts([prompts[i] for i in index], features), rank)
        outputs = _generate(self.local, [list(prompts[i]) for i in parts[0].tolist()], params)
        for rank in range(1, self.world_size):
            outputs.extend(_decode_generations(recv_tensors(rank), params.n))
        return outputs

    def finish_rollout(self) -> None:
        """Tell the other ranks that this step's generation is over."""
        for rank in range(1, self.world_size):
            send_tensors([torch.tensor([DONE])], rank)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.local.update_weights(weights)

    def sleep(self) -> None:
        self.local.sleep()

    def wake_up(self) -> None:
        self.local.wake_up()

    def shutdown(self) -> None:
        self.local.shutdown()


class SingleController(Controller):
    """One controller on rank 0 for all ranks (``--trainer.controllers 1``), the baseline of G-Core's
    parallel controllers. Rank 0 calls ``step`` with the whole step's prompts; the other ranks call it
    with none and serve generation and training for rank 0.

    The step is ``Controller.step``; this class overrides only the stages that differ: ``rollout``
    (rank 0 sends each rank its part of the prompts, the others serve it), the end of the rollout
    (rank 0 tells the others), ``prepare`` (rank 0 collates and scatters) and ``log`` (the bytes
    rank 0 sent)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rank, self.world = self.fabric.global_rank, self.fabric.world_size
        #: rank 0's view of every rank's engine (``None`` on the other ranks, which serve rank 0)
        self.remote = RemoteEngines(self.engine, self.world) if self.rank == 0 else None
        if self.remote is not None:
            self.engine = self.remote

    def rollout(self, record: StepRecord, prompts: list[Prompt], first_group: int = 0) -> list[Sample]:
        """Rank 0: the rollout of ``Controller`` on every rank's engine (``RemoteEngines``); the other
        ranks generate what rank 0 sends them until it says the rollout is over."""
        if self.remote is not None:
            features = [p.metadata["feature"] for p in prompts if p.metadata.get("feature") is not None]
            self.remote.features = torch.stack(features) if prompts and len(features) == len(prompts) else None
            return super().rollout(record, prompts, first_group)
        with record.timer("generate"):
            self.placement.before_generate(self.engine)
            self._serve_generation()
        with record.timer("swap"):
            self.placement.after_generate(self.engine)
        return []

    def end_rollout(self, record: StepRecord) -> None:
        """Rank 0 tells the other ranks that this step's generation is over."""
        if self.remote is not None:
            self.remote.finish_rollout()

    def prepare(self, record: StepRecord) -> RolloutBatch:
        """Rank 0 collates every sample and computes advantages; each rank gets its rows, computes the
        log-probabilities and values the algorithm needs on its own shard, and sends them back first
        when the advantages depend on them."""
        with record.timer("prepare"):
            if self.remote is not None:
                return self._prepare_everyone(self.remote, self._collate(record.kept, record.samples))
            own = _decode_batch(recv_tensors(0))
            if self._needs_model():
                self._model_outputs(own)
                send_tensors([_field_or_empty(own, name) for name in _MODEL_FIELDS], 0)
                return _decode_batch(recv_tensors(0))
            return own

    def log(self, record: StepRecord) -> None:
        """LOG, and the bytes rank 0 sent to the other ranks this step (``controller/sent_gb``)."""
        super().log(record)
        sent = 0
        if self.remote is not None:
            sent, self.remote.sent_bytes = self.remote.sent_bytes, 0
        record.metrics["controller/sent_gb"] = float(self._all_reduce(torch.tensor([float(sent)]), "sum")[0]) / 1e9

    def _needs_model(self) -> bool:
        algorithm = self.algorithm
        return (algorithm.needs_critic or algorithm.needs_old_logprobs or algorithm.needs_reference
                or algorithm.teacher_path is not None)

    def _prepare_everyone(self, remote: RemoteEngines, batch: RolloutBatch) -> RolloutBatch:
        """Rank 0's part of PREPARE: scatter the rows, gather what the other ranks computed on theirs,
        compute the advantages over the whole batch and scatter again; returns rank 0's rows."""
        parts = list(torch.arange(len(batch)).tensor_split(self.world))  # contiguous rows per rank
        if not self._needs_model():
            batch.advantages = self.algorithm.advantages(batch)
            return self._scatter(remote, batch, parts)
        own = self._scatter(remote, batch, parts)
        self._model_outputs(own)
        pieces = [[_field_or_empty(own, name) for name in _MODEL_FIELDS]]
        pieces += [recv_tensors(rank) for rank in range(1, self.world)]
        for i, name in enumerate(_MODEL_FIELDS):
            if getattr(own, name) is not None:
                setattr(batch, name, torch.cat([piece[i] for piece in pieces]))
        batch.advantages = self.algorithm.advantages(batch)
        return self._scatter(remote, batch, parts)

    def _serve_generation(self) -> None:
        """Generate what rank 0 sends until it says the rollout is over."""
        while True:
            message = recv_tensors(0)
            if int(message[0]) == DONE:
                return
            token_ids, _features = _decode_prompts(message)  # a multimodal engine would read the features
            outputs = _generate(self.engine, token_ids, self.sampling)
            send_tensors(_encode_generations(outputs), 0)

    def _scatter(self, remote: RemoteEngines, batch: RolloutBatch, parts: list[torch.Tensor]) -> RolloutBatch:
        """Send every other rank its rows; return rank 0's own. A rank without rows gets one row with a
        zero mask, so that it still joins every collective of the training step."""
        own = None
        for rank, index in enumerate(parts):
            rows = _rows(batch, index if len(index) else torch.tensor([0]))
            if not len(index):
                rows.response_mask = torch.zeros_like(rows.response_mask)
            if rank == 0:
                own = rows
            else:
                remote.sent_bytes += send_tensors(_encode_batch(rows), rank)
        assert own is not None  # rank 0 is among the parts
        return own


#: what ``Controller._model_outputs`` sets
_MODEL_FIELDS = ("values", "old_logprobs", "ref_logprobs", "teacher_logprobs")


def _field_or_empty(batch: RolloutBatch, name: str) -> torch.Tensor:
    value = getattr(batch, name)
    return value if value is not None else torch.empty(0)
