"""The torch backend's refusal tables: the combinations of its options that are invalid or untested, each refused
with one ``ConfigError`` naming the flags (when the backend is built, and for image prompts by ``validate_images``)."""

from __future__ import annotations

from gcore.backends import lora
from gcore.backends import sequence_parallel as seqpar
from gcore.errors import ConfigError


def check_options(strategy: str, *, sequence_parallel_size: int, packing: bool | None, lora_rank: int,
                  lora_alpha: int | None, lora_target_modules: list[str] | None, attn_implementation: str | None,
                  compile: bool, gradient_checkpointing: bool) -> None:
    """Refuse an invalid or untested combination of the options (one ``ConfigError`` naming the flags)."""
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"--backend.strategy {strategy!r}: valid choices: ddp, fsdp")
    fsdp, size = strategy == "fsdp", sequence_parallel_size
    if size < 1:
        raise seqpar.ConfigError(f"--backend.sequence_parallel_size {size} must be >= 1")
    if fsdp and size > 1:
        raise ConfigError(
            f"--backend.strategy fsdp does not support --backend.sequence_parallel_size {size} "
            "(untested: the sequence-parallel groups' collectives would interleave with FSDP's over all ranks); "
            "use --backend.strategy ddp with sequence parallelism, or --backend.sequence_parallel_size 1 with fsdp"
        )
    lora.check_options(lora_rank, lora_alpha, lora_target_modules)
    if lora_rank and (fsdp or size > 1):
        flag = "--backend.strategy fsdp" if fsdp else "--backend.sequence_parallel_size > 1"
        raise ConfigError(f"--backend.lora_rank {lora_rank} does not support {flag} (untested); use "
                          "--backend.strategy ddp and --backend.sequence_parallel_size 1, or --backend.lora_rank 0")
    if attn_implementation is not None and (size > 1 or packing):
        flag = f"--backend.sequence_parallel_size {size}" if size > 1 else "--backend.packing true"
        raise ConfigError(f"--backend.attn_implementation {attn_implementation} does not apply with {flag}: "
                          "it brings its own attention; leave --backend.attn_implementation unset")
    if compile:
        check_compile(strategy, size, packing, lora_rank, gradient_checkpointing)


def check_compile(strategy: str, sequence_parallel_size: int, packing: bool | None, lora_rank: int,
                  gradient_checkpointing: bool) -> None:
    """Refuse ``--backend.compile true`` where it is untested."""
    clash = {"--backend.strategy fsdp": strategy == "fsdp",
             f"--backend.sequence_parallel_size {sequence_parallel_size}": sequence_parallel_size > 1,
             "--backend.packing true": bool(packing), f"--backend.lora_rank {lora_rank}": lora_rank > 0,
             "--backend.gradient_checkpointing true": gradient_checkpointing}
    for flag, on in clash.items():
        if on:
            raise ConfigError(f"--backend.compile true does not support {flag} (untested); use --backend.compile false")


def check_images(sequence_parallel_size: int, packing: bool | None, compile: bool) -> None:
    """Refuse the options not yet tested with image prompts (one line naming the flag)."""
    clash = {f"--backend.sequence_parallel_size {sequence_parallel_size}": sequence_parallel_size > 1,
             "--backend.packing true": bool(packing), "--backend.compile true": compile}
    for flag, on in clash.items():
        if on:
            raise ConfigError(f"{flag} does not take image prompts yet (untested: the visual inputs are not "
                              "split or packed, nor run through compiled blocks); leave it at its default for "
                              "image prompts")
