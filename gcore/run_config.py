"""The run-level options (``--trainer.*``) and what a run returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gcore.errors import ConfigError
from gcore.loggers import LoggerName


@dataclass
class TrainerConfig:
    """Run-level options, named as in Lightning where they mean the same.

    Args:
        max_steps: training steps to run.
        accelerator: ``cpu``, ``cuda`` or ``auto``.
        devices: controllers (processes) per node; one per GPU on GPUs.
        num_nodes: machines (launched by torchrun or SLURM, as Fabric does).
        precision: Fabric precision, e.g. ``32-true`` or ``bf16-mixed``.
        seed: seeds model initialisation, data order and sampling.
        default_root_dir: where runs are written (``<root>/<name>/version_N``).
        name: the run's folder name under ``default_root_dir``.
        logger: ``csv``, ``tensorboard``, ``wandb``, ``mlflow``, or several as a list (the last two
            when their packages are installed).
        enable_progress_bar: show a progress bar with the live reward.
        save_final: save the trained policy as an HF checkpoint at the end.
        checkpoint_every: save a resumable checkpoint every N steps (0: never) under
            ``<default_root_dir>/<name>/checkpoints``.
        keep_checkpoints: how many complete checkpoints to keep.
        async_checkpoint: write checkpoints in the background while training goes on.
        resume: ``auto`` (the latest complete checkpoint that verifies, if any: a corrupt newer one is
            passed over with a one-line note) or a checkpoint folder; it may have been written by
            another number of controllers (elastic resume). A resumed run appends to its own
            ``metrics.csv`` (the steps it redoes are replaced). A checkpoint written with another
            seed or other data is refused in one line (see ``resume_changed_run``).
        resume_changed_run: resume even though this run's seed or data differ from those of the run
            that wrote the checkpoint (another algorithm, backend or model is always refused).
        collective_timeout: seconds a collective may wait for the other controllers before the run
            fails (instead of hanging when one of them died). A controller that is killed is named at
            once; one that is frozen is found by ``heartbeat_timeout``, usually much sooner.
        heartbeat_timeout: seconds a controller may send no heartbeat (sent every half second by a
            thread of its own, also while it computes) before the others declare it lost, name it,
            and end every process of the run, the silent one included.
        max_skipped_updates: stop the run after this many consecutive steps that skipped an update
            because the loss or the gradient was NaN or infinite (0: never stop).
        max_failed_env_steps: stop the run after this many consecutive steps in which every episode ended on an
            environment error (``env/errors`` equal to ``env/episodes``: an environment that cannot start or
            import, or that fails every call); the warnings before it name each rollout's first error (0: never
            stop).
        eval_every: evaluate on the held-out prompts (``--data.eval_path`` or the embedded task's test
            split) before the first step, every N steps and after the last (0: never); see
            ``gcore/evaluation.py`` for the ``eval/*`` metrics.
        controllers: ``None``: one controller per process (G-Core's parallel controllers); ``1``: one
            controller on rank 0 drives the engines and training shards of every process, and all
            rollout data passes through it (the single-driver baseline, for comparison).
        max_staleness: 0: the synchronous step. K >= 1: the rollouts of the next K steps run on the
            engine worker processes while this step trains (``--placement dynamic``, or ``static`` with
            ``--placement.workers``), so a sample is at most K versions old (a group with a sample that
            would be older is generated again, ``async/regenerated_stale``); the loss corrects for it
            (``--algorithm.behaviour_is_cap``). A checkpoint holds the prompts drawn ahead and the rollouts in
            flight, so a resumed run continues exactly over static engine workers. See docs/asynchronous.md.
        partial_rollouts: with ``max_staleness`` K >= 1, a weight update does not wait behind the generation in
            flight: the engine workers stop between tokens, load the new weights and continue the unfinished
            responses with them (no token thrown away; the prompt and tokens so far are prefilled again). Each
            token records the version that sampled it (``Sample.token_versions``); a sample's staleness is its
            oldest token's. Needs an engine that can stop between tokens (``EngineCapabilities.interrupt``:
            ``--engine hf``, or ``--engine vllm`` in its default in-process mode). docs/asynchronous.md.
        dispatch: with ``max_staleness`` K >= 1, when the rollout of a step goes out to the engine workers.
            ``device``: as soon as the weights it may be generated with exist (after the sync of the step K + 1
            before it): its requests queue behind the rollouts in flight, and each worker starts on it when it has
            finished its own share of those, without waiting for the slowest worker. ``step``: when the step K
            before it starts training, i.e. after that step's rollout came in from every worker. The weights and
            the seed are the same either way, so the samples are too; only when they are generated differs.
        oversample: with dynamic sampling (``--algorithm dapo``, ``max_rounds`` > 1), a step's rollout starts with
            the extra prompts that the last step's keep rate says its share will need, instead of drawing them in a
            second round once the verdicts of the first are in (a round that, with a generative judge, waits for
            it, and, with ``max_staleness``, queues behind the rollouts of later steps). Groups kept beyond the
            share are not trained (``filter/groups_surplus``); a second round is drawn only if the share is still
            short. docs/asynchronous.md.
        trace_every: rollout tracing: every N steps, each controller appends some of its step's samples (prompt,
            reply, reward and its parts, advantage, length, finish reason, policy versions, engine-vs-trainer
            log-probability gap, turns, image references) to ``samples.jsonl`` in the run folder, and rank 0 to the
            loggers with a text or table view; ``gcore samples RUN_DIR`` shows them (0: off). docs/observability.md.
        trace_samples: samples traced per step and controller, spread over the reward range (the best, the median
            and the worst among them; 0: every sample).
        trace_max_mb: the most megabytes each controller's trace file may grow to over the run; tracing stops there
            with one note (0: no cap).
    """

    max_steps: int = 30
    accelerator: Literal["cpu", "cuda", "gpu", "auto"] = "auto"
    devices: int = 1
    num_nodes: int = 1
    precision: str = "32-true"
    seed: int = 42
    default_root_dir: str = "gcore_runs"
    name: str = "gcore"
    logger: LoggerName | list[LoggerName] = "csv"
    enable_progress_bar: bool = True
    save_final: bool = True
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    async_checkpoint: bool = True
    resume: str | None = None
    resume_changed_run: bool = False
    collective_timeout: float = 600.0
    heartbeat_timeout: float = 30.0
    max_skipped_updates: int = 3
    max_failed_env_steps: int = 3
    controllers: int | None = None
    eval_every: int = 0
    max_staleness: int = 0
    partial_rollouts: bool = False
    dispatch: Literal["step", "device"] = "device"
    oversample: bool = False
    trace_every: int = 1
    trace_samples: int = 8
    trace_max_mb: float = 100.0

    def validate(self) -> None:
        """A one-line ``ConfigError`` for the first flag out of its range."""
        checks = [
            (self.max_steps >= 1, f"--trainer.max_steps must be >= 1, got {self.max_steps}"),
            (self.devices >= 1, f"--trainer.devices must be >= 1, got {self.devices}"),
            (self.checkpoint_every >= 0,
             f"--trainer.checkpoint_every must be >= 0 (0: no checkpoints), got {self.checkpoint_every}"),
            (self.keep_checkpoints >= 1, f"--trainer.keep_checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (self.heartbeat_timeout > 0,
             f"--trainer.heartbeat_timeout must be > 0 seconds, got {self.heartbeat_timeout}"),
            (self.collective_timeout > 0,
             f"--trainer.collective_timeout must be > 0 seconds, got {self.collective_timeout}"),
            (self.max_skipped_updates >= 0,
             f"--trainer.max_skipped_updates must be >= 0, got {self.max_skipped_updates}"),
            (self.max_failed_env_steps >= 0,
             f"--trainer.max_failed_env_steps must be >= 0, got {self.max_failed_env_steps}"),
            (self.eval_every >= 0, f"--trainer.eval_every must be >= 0, got {self.eval_every}"),
            (self.max_staleness >= 0, f"--trainer.max_staleness must be >= 0 (0: synchronous; K: the rollouts of "
             f"the next K steps run while this one trains), got {self.max_staleness}"),
            (self.trace_every >= 0,
             f"--trainer.trace_every must be >= 0 (0: no rollout tracing), got {self.trace_every}"),
            (self.trace_samples >= 0,
             f"--trainer.trace_samples must be >= 0 (0: every sample of a traced step), got {self.trace_samples}"),
            (self.trace_max_mb >= 0, f"--trainer.trace_max_mb must be >= 0 (0: no cap), got {self.trace_max_mb}"),
            (not self.partial_rollouts or self.max_staleness >= 1,
             "--trainer.partial_rollouts true continues the rollouts in flight across a weight update: it needs "
             "--trainer.max_staleness >= 1 (rollouts that run while a step trains)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass
class FitResult:
    """What ``fit`` returns on rank 0 (``None`` fields on other ranks).

    ``evaluations`` holds the ``--trainer.eval_every`` results, each with the ``step`` (updates
    done) it measured.
    """

    run_dir: str | None
    final_model_dir: str | None
    history: list[dict[str, float]] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)
