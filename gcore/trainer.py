"""The ``Trainer``: launches the controllers with Lightning Fabric and wires, in each, the run that loops over
the steps (``gcore/run_loop.py``)."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from gcore import threads
from gcore.algorithms.base import Algorithm
from gcore.backends.base import TrainingBackend
from gcore.checkpointer import Checkpointer
from gcore.controller import Controller
from gcore.data import (
    CostBalancer,
    DataConfig,
    PromptSampler,
    check_images,
    check_tokenizer,
    load_eval_prompts,
    load_prompts,
    with_synthetic_feature,
)
from gcore.engines.base import Engine
from gcore.envs.base import Environment
from gcore.errors import ConfigError, PluginExit
from gcore.inflight import InFlightRollouts, check_options
from gcore.liveness import SIGNALS, ControllerWatch, report_rank_failure
from gcore.loggers import make_logger, quiet_dependencies
from gcore.model import (
    ModelConfig,
    ModelSource,
    family_checks,
    image_text_to_text,
    load_tokenizer,
    make_workdir,
    materialize,
)
from gcore.placement.base import PlacementPolicy
from gcore.rendezvous import loopback_store
from gcore.rewards.base import RewardModel, prepare_judges
from gcore.run_config import FitResult, TrainerConfig
from gcore.run_dir import check_root_writable, check_run_writable, open_run_dir
from gcore.run_lock import RunLock
from gcore.run_loop import ControllerRun
from gcore.types import Prompt, SamplingParams
from gcore.user_code import culprit, describe, ending_as

if TYPE_CHECKING:
    from lightning_fabric import Fabric
    from lightning_fabric.loggers import Logger
    from transformers import PreTrainedTokenizerBase

#: the run directory's folder of a ``.gguf`` judge's conversion (``GenerativeReward.prepare``), removed at the end
JUDGE_FOLDER = "converted-judge"


class Trainer:
    """Trains a policy with RL: ``Trainer(algorithm=GRPO(), ...).fit()``.

    Every argument has a default, so ``Trainer().fit()`` trains the embedded default task. Plugins
    are passed as instances, so a notebook can subclass any of them and pass its own.
    """

    def __init__(
        self,
        trainer: TrainerConfig | None = None,
        model: ModelConfig | None = None,
        data: DataConfig | None = None,
        sampling: SamplingParams | None = None,
        engine: Engine | None = None,
        reward: RewardModel | None = None,
        algorithm: Algorithm | None = None,
        placement: PlacementPolicy | None = None,
        backend: TrainingBackend | None = None,
        env: Environment | None = None,
    ) -> None:
        from gcore.algorithms.grpo import GRPO
        from gcore.backends.torch import TorchBackend
        from gcore.engines.hf import HFEngine
        from gcore.envs.base import SingleTurn
        from gcore.placement.static import StaticPlacement
        from gcore.rewards.rule import TargetCharReward

        self.config = trainer or TrainerConfig()
        self.model_config = model or ModelConfig()
        self.data_config = data or DataConfig()
        self.sampling = sampling or SamplingParams()
        self.engine = engine or HFEngine()
        self.reward = reward or TargetCharReward(length=self.sampling.max_new_tokens)
        self.algorithm = algorithm or GRPO()
        # on-policy distillation with the teacher on an engine of its own: it scores the samples after the reward,
        # and a placement policy places it as a generative judge (``TeacherScoring``)
        teacher_scoring = getattr(self.algorithm, "teacher_scoring", None)
        if teacher_scoring is not None:
            self.reward = teacher_scoring(self.reward, self.sampling.temperature)
        self.placement = placement or StaticPlacement()
        self.backend = backend or TorchBackend()
        self.env = env or SingleTurn()
        self.rollout_engine: Engine = self.engine  # what the controller calls; set by the placement's launch
        self._loggers: list[Logger] = []  # made with the run's Fabric
        with ending_as(self._plugin_exit):
            self._validate()

    def _validate(self) -> None:
        """Every check that needs no process: the trainer's own flags, then the plugins' (``validate``)."""
        c = self.config
        c.validate()
        self.sampling.validate_for_training()
        check_options(c.max_staleness, c.partial_rollouts, c.oversample, self.placement, self.engine,
                      self.algorithm)
        world = self._world_size()
        if c.controllers not in (None, 1, world):
            raise ConfigError(f"--trainer.controllers {c.controllers}: valid choices are 1 (one controller drives "
                              f"every process) or {world} (one per process, the default)")
        if c.eval_every and self._single_controller():
            raise ConfigError("--trainer.eval_every runs with one controller per process (not --trainer.controllers 1)")
        self.backend.validate(self.algorithm, world, single_controller=self._single_controller())
        self.placement.validate(world, single_controller=self._single_controller())
        if self.data_config.has_images:
            self._validate_images()
        if getattr(self.backend, "routing_replay", False):
            self._validate_routing_replay()

    def _validate_routing_replay(self) -> None:
        """``--backend.routing_replay`` (docs/moe.md): refuse, in one line naming the option, where the engine's routes
        cannot reach the trainer; else turn on the engine's recording (``--engine.record_routes``)."""
        flag, engine = "--backend.routing_replay true", self.engine
        name = type(engine).__name__
        if not engine.capabilities.routes:
            raise ConfigError(f"{flag}: --engine {name} does not record the experts it routes to; use --engine hf "
                              "(its own loop, --engine.use_generate false) or vllm")
        workers = getattr(self.placement, "workers", 0)
        if type(self.placement).__name__ != "StaticPlacement" or workers:
            raise ConfigError(f"{flag}: the routes are recorded by an engine in the trainer's process only; "
                              f"--placement {type(self.placement).__name__} with engine workers does not carry them "
                              "back yet: use --placement static without --placement.workers")
        if self._single_controller():
            raise ConfigError(f"{flag}: --trainer.controllers 1 sends generations as token tensors, without their "
                              "routes; use one controller per process")
        if self.env.multi_turn:
            raise ConfigError(f"{flag}: multi-turn episodes (--env {type(self.env).__name__}) do not carry routes "
                              "yet; use --env single_turn")
        setattr(engine, "record_routes", True)  # noqa: B010  the attribute ``capabilities.routes`` promises

    def _validate_images(self) -> None:
        """Image prompts (docs/multimodal.md): refuse, in one line naming the option, what does not take them yet."""
        d = self.data_config
        what = f"--data.image_key {d.image_key}" if d.image_key is not None else f"--data.task {d.task}"
        if not self.engine.capabilities.images:
            raise ConfigError(f"{what}: image prompts need --engine hf or vllm; {type(self.engine).__name__} is given "
                              "token ids only in gcore (SGLang: its image inputs are not wired, and its CPU build was "
                              "not tried with an image-text-to-text model)")
        if not self.placement.supports_images:
            raise ConfigError(f"{what}: --placement {type(self.placement).__name__} does not hand its engines the "
                              "prompts' images (supports_images); use --placement static or dynamic")
        if self._single_controller():
            raise ConfigError(f"{what}: --trainer.controllers 1 sends prompts as token tensors, without their "
                              "images; use one controller per process")
        if self.env.multi_turn:
            raise ConfigError(f"{what}: multi-turn episodes (--env {type(self.env).__name__}) do not carry images "
                              "yet; use --env single_turn")
        self.backend.validate_images()

    def _plugin_exit(self, cause: BaseException) -> PluginExit | None:
        """The one-line error for a plugin's code that ended the process (``user_code.ending_as``), naming the
        plugin's family, class and method; ``None`` when no plugin's code was running."""
        plugins = [("engine", self.engine), ("engine", self.rollout_engine), ("reward", self.reward),
                   ("algorithm", self.algorithm), ("placement", self.placement), ("backend", self.backend),
                   ("env", self.env), *(("logger", logger) for logger in self._loggers)]
        where = culprit(cause, plugins)
        if where is None:
            return None
        return PluginExit(f"{where} raised {describe(cause)}; a plugin's code must raise an exception, not end "
                          "the process")

    def _users_reward(self) -> RewardModel:
        """The run's reward as configured: without the distillation teacher's scoring (``TeacherScoring``)."""
        return getattr(self.reward, "users_reward", self.reward)

    def _world_size(self) -> int:
        return self.config.devices * self.config.num_nodes

    def _single_controller(self) -> bool:
        """Whether one controller drives every process (``--trainer.controllers 1`` with several)."""
        return self.config.controllers == 1 and self._world_size() > 1

    def fit(self) -> FitResult:
        """Launch the controllers and train for ``max_steps``; returns the run's results on rank 0."""
        c = self.config
        quiet_dependencies()
        threads.warn_if_spinning()
        check_root_writable(c.default_root_dir)
        lock = RunLock(os.path.join(c.default_root_dir, c.name))
        if _launching_process():  # one run per run folder; the controllers it launches share its lock
            lock.acquire()
        try:
            with ending_as(self._plugin_exit):  # a plugin's ``sys.exit`` anywhere in the run: one line, exit 2
                return self._fit()
        finally:
            lock.release()

    def _fit(self) -> FitResult:
        c = self.config
        signature = _run_signature(c, self.model_config, self.data_config, self.algorithm, self.backend)
        checkpointer = Checkpointer(os.path.join(c.default_root_dir, c.name, "checkpoints"),
                                    every=c.checkpoint_every, keep=c.keep_checkpoints, asynchronous=c.async_checkpoint,
                                    resume=c.resume, seed=c.seed, signature=signature,
                                    collective_timeout=c.collective_timeout, allow_changed_run=c.resume_changed_run)
        checkpointer.pick(c.max_steps)  # before anything is built: nothing to do fails at once
        check_run_writable(checkpointer, c.default_root_dir, c.name, c.checkpoint_every)
        fabric, device_type, self._loggers = _make_fabric(c, self.backend, self._world_size(),
                                                          checkpointer.resumed_log_version())
        # invalid combinations failed in __init__ (``_validate``); the placement's fit to the devices fails
        # here, once, before any controller process or engine is launched
        self.placement.setup(self._world_size(), device_type, self.reward)
        workdir = make_workdir()
        # undone in reverse order, each step also when one before it raised (a Ctrl-C during the teardown): the
        # caller's signal handlers always come back
        cleanup = contextlib.ExitStack()
        cleanup.callback(self.engine.shutdown)
        cleanup.callback(self.placement.shutdown)
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        cleanup.callback(SIGNALS.install())
        try:
            # before the process group exists: transformers saves only on rank 0 once it does, and
            # every controller builds (and loads) its own copy of the embedded model
            images = self.data_config.has_images
            tokenizer = load_tokenizer(self.model_config, vision=images)
            check_tokenizer(self.data_config, tokenizer)  # before the model is built and controllers launched
            check_images(self.data_config)  # every image of the data files read once, here
            source = self.model_config.source(materialize(self.model_config, tokenizer, c.seed, workdir, images))
            if images and not image_text_to_text(source.path, source.trust_remote_code):
                raise ConfigError(f"--model.path {source.path}: image prompts need an image-text-to-text checkpoint "
                                  "(one AutoModelForImageTextToText loads), with its processor")
            # a .gguf judge converted once for the run, before any controller or engine worker loads it: the
            # controllers this process launches find the conversion in the run directory
            judge_folder = os.path.join(c.default_root_dir, c.name, JUDGE_FOLDER)
            if _launching_process():
                cleanup.callback(shutil.rmtree, judge_folder, ignore_errors=True)
            prepare_judges(self.reward, judge_folder)
            # the single-node rendezvous store lives as long as the run
            cleanup.enter_context(loopback_store(fabric, c.num_nodes, c.collective_timeout))
            cleanup.enter_context(threads.launching())  # Fabric's OMP_NUM_THREADS in a controller is not the user's
            fabric.launch()
            return self._run(fabric, tokenizer, source, checkpointer)
        finally:
            cleanup.close()

    def _run(self, fabric: Fabric, tokenizer: PreTrainedTokenizerBase, source: ModelSource,
             checkpointer: Checkpointer) -> FitResult:
        """In every controller: set up, run the loop; with several controllers a watch names one that
        is lost, and a failure says which controller failed and why."""
        watch = None
        if fabric.world_size > 1:  # names a controller that dies, and stops this one if it is lost
            watch = ControllerWatch.for_fabric(fabric, silence_limit=self.config.heartbeat_timeout)
        try:
            run = self._setup(fabric, tokenizer, source, checkpointer)
            try:
                result = run.loop()
            finally:
                gc.unfreeze()  # (``loop`` froze what setup built) collected as usual again after the run
                if run.governor is not None:
                    run.governor.restore()
            if watch is not None:
                watch.stop()
                fabric.barrier()  # no controller exits (taking the store with it) while another still watches
                import torch.distributed

                torch.distributed.destroy_process_group()  # no rank exits with gloo's threads still attached
            return result
        except Exception as err:
            if fabric.world_size == 1:
                raise
            report_rank_failure(fabric.global_rank, err, watch)

    # WIRING: what the loop runs on, built once per controller process ---------------------------

    def _setup(self, fabric: Fabric, tokenizer: PreTrainedTokenizerBase, source: ModelSource,
               checkpointer: Checkpointer) -> ControllerRun:
        """Load the prompts, set up the backend, let the placement policy start the engines, then build
        the prompt streams and the controller, hand the run's state to the checkpointer, resume, and
        open the run folder."""
        c, rank = self.config, fabric.global_rank
        processor = self._processor(source)
        prompts = load_prompts(self.data_config, tokenizer, self.sampling.max_new_tokens, source.context_length(),
                               processor)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.sampling.stop_token_ids:
            self.sampling.stop_token_ids = (*self.sampling.stop_token_ids, tokenizer.eos_token_id)
        if not self.model_config.embedded:  # Gemma 3: <end_of_turn> ends a reply; float16 refused
            stops = family_checks(source, getattr(self.engine, "dtype", None))
            self.sampling.stop_token_ids += tuple(t for t in stops if t not in self.sampling.stop_token_ids)
        fabric.seed_everything(c.seed + rank, verbose=False)  # different samples per controller

        central = self._single_controller()
        self.backend.setup(fabric, source, self.algorithm, embedded=self.model_config.embedded)
        # the placement policy starts the engines where it places them (in this process by default)
        if rank == 0 and self.placement.describe():
            print(self.placement.describe(), flush=True)
        self.placement.heartbeat_timeout = c.heartbeat_timeout  # engine workers' liveness deadline too
        teacher = getattr(self.reward, "teacher_source", None)  # ``TeacherScoring``'s
        if teacher is not None:  # the teacher engine scores the student's token ids: the same vocabulary
            from gcore.algorithms.distill import check_teacher_vocabulary

            check_teacher_vocabulary(source, teacher)
        self.rollout_engine = self.placement.launch(self.engine, self.reward, source, fabric.device,
                                                    seed=c.seed + 1000 * rank)
        balancer = (CostBalancer(prompts, self.sampling.n, self.sampling.max_new_tokens)
                    if self.data_config.balance else None)
        # with one controller, rank 0 takes every step's whole batch and the other ranks take none
        shard_rank, shards = (0, 1) if central else (rank, fabric.world_size)
        sampler = PromptSampler(len(prompts), self.data_config.prompts_per_step, shard_rank, shards,
                                c.seed, self.data_config.shuffle, balancer)
        # dynamic sampling draws extra prompts from a stream of this rank's own (no other rank waits)
        extra = PromptSampler(len(prompts), 1, 0, 1, c.seed + 7919 * (rank + 1), self.data_config.shuffle)
        feature_mb = self.data_config.synthetic_feature_mb

        def take(indices: list[int]) -> list[Prompt]:
            return [with_synthetic_feature(prompts[i], feature_mb) for i in indices]

        rollouts = InFlightRollouts(c.max_staleness, early_dispatch=c.dispatch == "device",
                                    partial=c.partial_rollouts, oversample=c.oversample, seed=c.seed,
                                    max_steps=c.max_steps, sampler=sampler, take=take, reward=self.reward,
                                    draw_prompts=lambda k: take([extra.next_global()[0] for _ in range(k)]))
        controller_class = Controller
        if central:
            from gcore.single_controller import SingleController

            controller_class = SingleController
        controller = controller_class(fabric, self.rollout_engine, self.reward, self.algorithm, self.backend,
                                      self.placement, tokenizer, self.sampling, rollouts=rollouts, env=self.env)
        controller.setup()
        checkpointer.setup(fabric, self.backend, shared={"sampler": sampler, "algorithm": self.algorithm,
                                                         "placement": self.placement},
                           own={"extra_sampler": extra}, halves={"in_flight": rollouts}, hf_files=source.path)
        start_step = checkpointer.load()
        if start_step:  # the engines generate with the weights resumed
            self.rollout_engine.update_weights(self.backend.named_weights())
            for note in rollouts.resume(start_step) if rank == 0 else []:
                print(f"gcore: note: resume with --trainer.max_staleness {c.max_staleness}: {note}", flush=True)
        run_dir = open_run_dir(fabric, start_step, checkpointer, self.hyperparameters()) if rank == 0 else None
        eval_prompts = self._eval_prompts(tokenizer, source, processor)

        def evaluate() -> dict[str, float]:
            from gcore.evaluation import evaluate

            return evaluate(self.rollout_engine, self._users_reward(), tokenizer, eval_prompts, self.sampling, fabric,
                            self.env)

        return ControllerRun(fabric, tokenizer, controller, rollouts, balancer, checkpointer, start_step, run_dir,
                             eval_prompts, central, c, self.data_config.prompts_per_step, evaluate, self._plugin_exit,
                             governor=threads.governor(fabric.device.type))

    def _processor(self, source: ModelSource) -> Any:  # noqa: ANN401  a transformers processor
        """The model's processor, for image prompts (``None`` without)."""
        if not self.data_config.has_images:
            return None
        from gcore.vision import load_processor

        return load_processor(source.path, source.trust_remote_code)

    def _eval_prompts(self, tokenizer: PreTrainedTokenizerBase, source: ModelSource, processor: Any = None,  # noqa: ANN401
                      ) -> list[Prompt]:
        """The held-out prompts of ``--trainer.eval_every`` (none when it is 0)."""
        if not self.config.eval_every:
            return []
        return load_eval_prompts(self.data_config, tokenizer, self.sampling.max_new_tokens, source.context_length(),
                                 processor)

    def hyperparameters(self) -> dict:
        """The run's configuration as plain values, for loggers."""

        def plugin(obj: object) -> dict:
            public = {k: v for k, v in vars(obj).items()
                      if not k.startswith("_") and isinstance(v, (int, float, str, bool, tuple, type(None)))}
            return {"class": f"{type(obj).__module__}.{type(obj).__qualname__}", **public}

        return {
            "trainer": asdict(self.config),
            "model": asdict(self.model_config),
            "data": asdict(self.data_config),
            "sampling": asdict(self.sampling),
            "engine": plugin(self.engine),
            "reward": plugin(self._users_reward()),
            "algorithm": plugin(self.algorithm),
            "placement": plugin(self.placement),
            "backend": plugin(self.backend),
            "env": plugin(self.env),
        }


def _make_fabric(c: TrainerConfig, backend: TrainingBackend, world_size: int, log_version: int | None,
             ) -> tuple[Fabric, str, list[Logger]]:
    """Fabric with this run's loggers (a resumed run writes into its own ``version_N``) and the
    backend's strategy; the device type, ``cpu`` or ``cuda``; the loggers."""
    from datetime import timedelta

    from lightning_fabric import Fabric

    accelerator = c.accelerator
    if accelerator == "auto":
        import torch

        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = "cuda" if accelerator in ("cuda", "gpu") else "cpu"
    names = [c.logger] if isinstance(c.logger, str) else list(c.logger)
    loggers = [make_logger(name, c.default_root_dir, c.name, log_version) for name in names]
    strategy = backend.strategy(world_size, device_type, timedelta(seconds=c.collective_timeout))
    fabric = Fabric(accelerator=accelerator, devices=c.devices, num_nodes=c.num_nodes, strategy=strategy,
                    precision=c.precision, loggers=loggers)  # type: ignore[arg-type]  # a precision string
    return fabric, device_type, list(loggers)


def _run_signature(c: TrainerConfig, m: ModelConfig, d: DataConfig, algorithm: Algorithm,
                   backend: TrainingBackend) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by this run: the algorithm, backend and model shape."""
    model = {"path": os.path.abspath(m.path)} if m.path is not None else {
        key: getattr(m, key) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "intermediate_size")}
    if m.path is None and m.architecture != "qwen2":  # a dense model's signature is what it was before MoE
        model.update({key: getattr(m, key) for key in ("architecture", "num_experts", "num_experts_per_tok",
                                                       "moe_intermediate_size")})

    def name(obj: object) -> str:
        return f"{type(obj).__module__}.{type(obj).__qualname__}"

    data = {"path": os.path.abspath(d.path) if d.path else None, "task": None if d.path else d.task}
    return {"algorithm": name(algorithm), "backend": name(backend), "model": model,
            "seed": c.seed, "data": data}


def _launching_process() -> bool:
    """Whether this is the process that launches the run (not a controller Fabric or torchrun started)."""
    ranks = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")
    return all(os.environ.get(var, "0") == "0" for var in ranks)


def fit(**kwargs: Any) -> FitResult:  # noqa: ANN401  Trainer's arguments
    """Shortcut for ``Trainer(**kwargs).fit()``."""
    return Trainer(**kwargs).fit()
