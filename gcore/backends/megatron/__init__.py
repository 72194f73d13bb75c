"""``megatron`` backend: megatron-core's GPT model with tensor, pipeline, context and data parallelism.

One module per job, in the order a step uses them:

- ``backend.py``: ``MegatronBackend``, the ``TrainingBackend`` (flags, setup, PREPARE, TRAIN, SYNC, checkpoints);
- ``parallel.py``: megatron-core's process groups over Fabric's, and the union of batches a group trains on;
- ``model.py``: the ``GPTModel`` (this rank's stage and tensor-parallel shard) from an HF config;
- ``weights.py``: this rank's tensors as full HF tensors and back (weights and Adam moments);
- ``convert.py``: the HF <-> megatron tensor conversion itself (no megatron-core needed);
- ``forward.py``: forward/backward passes, log-probabilities, the 1F1B micro-batch schedule;
- ``logprobs.py``: log-probabilities and entropies on vocabulary shards (tensor parallelism);
- ``optimizer.py``: torch AdamW or megatron's distributed optimizer, gradient reduction and clipping;
- ``context_parallel.py``: gcore's ring/Ulysses attention inside megatron's layers (``sequence_parallel_size``);
- ``cpu.py``: what megatron-core needs to run on a CPU-only torch.

Nothing here imports megatron-core at import time: choosing the backend without it stops with
the install hint. What is supported and what is not: ``docs/megatron.md``.
"""

from gcore.backends.megatron.backend import MegatronBackend

__all__ = ["MegatronBackend"]
