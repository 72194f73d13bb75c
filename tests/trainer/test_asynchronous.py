"""``--trainer.max_staleness``: rollouts that run while the controller trains (docs/asynchronous.md)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from gcore.algorithms.base import LossScale
from gcore.algorithms.grpo import GRPO
from gcore.data import DataConfig
from gcore.errors import ConfigError
from gcore.model import ModelConfig
from gcore.placement.base import InFlight, Telemetry
from gcore.placement.dynamic import DynamicPlacement
from gcore.placement.static import StaticPlacement
from gcore.rewards.base import RewardModel
from gcore.rewards.generative import GenerativeReward
from gcore.rollout import RolloutJob
from gcore.trainer import Trainer, TrainerConfig
from gcore.types import RolloutBatch, SamplingParams


def one_row(advantage: float, behaviour: list[float] | None, old: list[float] | None = None) -> RolloutBatch:
    """One sequence of 4 tokens whose last 3 are the response."""
    return RolloutBatch(
        input_ids=torch.zeros(1, 4, dtype=torch.long),
        attention_mask=torch.ones(1, 4, dtype=torch.long),
        response_mask=torch.ones(1, 3),
        rewards=torch.zeros(1),
        group_ids=torch.zeros(1, dtype=torch.long),
        engine_logprobs=torch.zeros(1, 3),
        advantages=torch.tensor([advantage]),
        old_logprobs=None if old is None else torch.tensor([old]),
        behaviour_logprobs=None if behaviour is None else torch.tensor([behaviour]),
    )


SCALE = LossScale(tokens=3.0, sequences=1.0, max_length=3.0)


def test_the_decoupled_loss_weighs_each_token_by_the_truncated_behaviour_ratio():
    """No old log-probabilities (one epoch, one mini-batch): the proximal policy is the current one,
    so PPO's ratio is 1 and each token's loss is -A times min(pi / pi_behav, cap)."""
    current = [-1.0, -0.5, -2.0]
    behaviour = [-1.2, -0.5, -3.0]
    logprobs = torch.tensor([current], requires_grad=True)
    algorithm = GRPO(behaviour_is_cap=2.0)
    loss, shares = algorithm.loss(logprobs, one_row(1.0, behaviour), SCALE)
    weights = [math.exp(0.2), 1.0, 2.0]  # exp(-1 + 1.2), exp(0), exp(1) = 2.718 truncated at 2
    assert loss.item() == pytest.approx(-sum(weights) / 3, rel=1e-6)
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-w / 3 for w in weights], rel=1e-6)
    deviation = (math.exp(0.2) - 1 + 0 + math.e - 1) / 3
    assert shares["async/behaviour_ratio_dev"].item() == pytest.approx(deviation, rel=1e-6)
    assert shares["async/behaviour_truncated_frac"].item() == pytest.approx(1 / 3)


def test_the_decoupled_loss_clips_against_the_proximal_policy_and_weighs_by_proximal_over_behaviour():
    """With old (proximal) log-probabilities: PPO's clip around pi_prox, times pi_prox / pi_behav."""
    proximal, current, behaviour = [-1.0, -1.0, -1.0], [-0.5, -1.0, -1.5], [-1.0, -1.5, -0.9]
    algorithm = GRPO(clip_eps=0.2, behaviour_is_cap=2.0)
    loss, _ = algorithm.loss(torch.tensor([current]), one_row(-1.0, behaviour, proximal), SCALE)
    # A = -1: per token max(-A r, -A clip(r, 0.8, 1.2)) = max(r, clip(r))
    ratios = [math.exp(0.5), 1.0, math.exp(-0.5)]
    surrogate = [max(r, min(max(r, 0.8), 1.2)) for r in ratios]  # 1.6487, 1, 0.8
    weights = [1.0, math.exp(0.5), math.exp(-0.1)]  # pi_prox / pi_behav, all under the cap
    expected = sum(s * w for s, w in zip(surrogate, weights, strict=True)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_without_behaviour_log_probabilities_the_loss_is_the_synchronous_one():
    logprobs = torch.tensor([[-1.0, -0.5, -2.0]])
    algorithm = GRPO()
    synchronous, shares = algorithm.loss(logprobs, one_row(1.0, None), SCALE)
    assert synchronous.item() == -1.0 and not any(k.startswith("async/") for k in shares)
    on_policy, _ = algorithm.loss(logprobs, one_row(1.0, [-1.0, -0.5, -2.0]), SCALE)
    assert on_policy.item() == synchronous.item()  # behaviour = current: every weight is exactly 1


def test_max_staleness_is_refused_where_the_engine_runs_in_the_controller(tmp_path):
    for placement in (StaticPlacement(), StaticPlacement(workers=0)):
        with pytest.raises(ConfigError, match=r"--trainer.max_staleness 1 needs engine worker processes.*"
                                              r"--placement dynamic, or --placement static with --placement.workers"):
            Trainer(trainer=TrainerConfig(max_staleness=1, default_root_dir=str(tmp_path)), placement=placement)
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        Trainer(trainer=TrainerConfig(max_staleness=-1), placement=DynamicPlacement())
    Trainer(trainer=TrainerConfig(max_staleness=3, default_root_dir=str(tmp_path)), placement=DynamicPlacement())


@pytest.mark.integration
def test_the_refusal_comes_from_the_cli_before_any_process_starts(gcore_cli):
    result = gcore_cli("--trainer.max_staleness", "1")
    assert result.returncode == 2
    assert "needs engine worker processes" in result.stderr and "Traceback" not in result.stderr


class RecordingGRPO(GRPO):
    """GRPO that records the policy version of every trained sample, step by step."""

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        assert batch.policy_versions is not None  # set whenever max_staleness >= 1
        self.versions.append(batch.policy_versions.tolist())
        self.groups.append(batch.group_ids.tolist())
        return super().advantages(batch)

    def __init__(self) -> None:
        super().__init__()
        self.versions: list[list[int]] = []
        self.groups: list[list[int]] = []


class LaggingPlacement(StaticPlacement):
    """The engine in the controller's process, pretending to overlap: a rollout started ahead runs when it
    is collected, and its first group comes back recorded as sampled by weights ``max_staleness + 1``
    versions older than the controller had when it started the rollout (as a worker that missed weight
    updates would): at any step, more than ``max_staleness`` versions old."""

    def __init__(self, max_staleness: int) -> None:
        super().__init__()
        self.max_staleness = max_staleness

    @property
    def supports_overlap(self) -> bool:
        return True

    def start_rollout(self, job: RolloutJob):
        def result():
            samples = self.rollout(job)
            for sample in samples:
                if sample.group == 0:
                    sample.policy_version = job.policy_version - self.max_staleness - 1
            return samples

        return InFlight(result)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_sample_older_than_max_staleness_is_never_trained_its_group_is_generated_again(tmp_path, max_staleness):
    algorithm, steps, prompts, n = RecordingGRPO(), 4, 3, 2
    result = Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              save_final=False, max_staleness=max_staleness, logger=[]),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(prompts_per_step=prompts), sampling=SamplingParams(n=n, max_new_tokens=4),
        algorithm=algorithm, placement=LaggingPlacement(max_staleness),
    ).fit()
    for step, versions in enumerate(algorithm.versions):
        assert len(versions) == prompts * n and all(0 <= step - v <= max_staleness for v in versions), (step, versions)
        assert sorted(set(algorithm.groups[step])) == list(range(prompts))  # the stale group replaced, not lost
    history = result.history
    # step 0 generates now; every later step's rollout was started ahead, its first group recorded too old
    assert [row["async/regenerated_stale"] for row in history] == [0.0] + [float(n)] * (steps - 1)
    assert all(row["async/staleness_max"] <= max_staleness for row in history)
    assert [row["samples/trained"] for row in history] == [float(prompts * n)] * steps


def _recorded_run(tmp_path, placement, steps, max_staleness):
    """A tiny run over engine workers whose algorithm records the policy versions it trains on."""
    algorithm = RecordingGRPO()
    result = Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              save_final=False, max_staleness=max_staleness),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(prompts_per_step=4), sampling=SamplingParams(n=4, max_new_tokens=6),
        algorithm=algorithm, placement=placement,
    ).fit()
    return algorithm, result


@pytest.mark.integration
@pytest.mark.slow  # starts two engine worker processes: ~30-60 s each
@pytest.mark.parametrize("placement", [lambda: DynamicPlacement(workers=2), lambda: StaticPlacement(workers=2)],
                         ids=["dynamic", "static_workers"])
def test_two_steps_off_trains_on_samples_at_most_two_versions_old(placement, tmp_path):
    steps = 5
    algorithm, result = _recorded_run(tmp_path, placement(), steps, max_staleness=2)
    # step 0 generates now and starts steps 1 and 2 with version 0; from then on step s starts step s + 2
    # with version s, trained two versions old
    expected = [0, 1, 2, 2, 2]
    assert [sorted({step - v for v in versions}) for step, versions in enumerate(algorithm.versions)] == \
        [[k] for k in expected]
    history = result.history
    assert [row["async/staleness_max"] for row in history] == [float(k) for k in expected]
    assert [row["async/regenerated_stale"] for row in history] == [0.0] * steps
    assert all(row["samples/trained"] == 16.0 and math.isfinite(row["loss"]) for row in history)


@pytest.mark.integration
@pytest.mark.slow  # like the other runs over engine workers (tests/placement/test_placement_workers.py): ~30-60 s each
@pytest.mark.parametrize("placement", [DynamicPlacement(workers=1), StaticPlacement(workers=1)],
                         ids=["dynamic", "static_workers"])
def test_one_step_off_trains_only_on_samples_at_most_one_version_old(placement, tmp_path):
    steps = 4
    algorithm, result = _recorded_run(tmp_path, placement, steps, max_staleness=1)
    assert len(algorithm.versions) == steps
    # step 0 has nothing in flight before it: its samples are fresh; every later step trains on the
    # rollout started during the step before it, with the weights of that step (one version old)
    for step, versions in enumerate(algorithm.versions):
        assert versions and all(step - v == (0 if step == 0 else 1) for v in versions), (step, versions)
    history = result.history
    assert [row["async/staleness_max"] for row in history] == [0.0] + [1.0] * (steps - 1)
    assert all(math.isfinite(row["async/behaviour_ratio_dev"]) for row in history)


@pytest.mark.integration
@pytest.mark.slow  # starts an engine worker process
def test_a_queued_weight_update_reaches_the_worker_after_the_generation_sent_before_it(tmp_path):
    """With ``queue_syncs`` the sync returns without waiting; the request in flight still samples with the
    old weights, the next one with the new."""
    from gcore.engines.hf import HFEngine
    from gcore.engines.pool import POLICY, RoleSpec, WorkerPool
    from gcore.model import ModelSource, char_tokenizer, materialize

    path = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(),
                       seed=0, workdir=str(tmp_path / "policy"))
    greedy, prompts = SamplingParams(n=1, max_new_tokens=8, temperature=0.0), [[5, 6, 7], [8, 9]]
    old, new = HFEngine(), HFEngine()
    for engine in (old, new):
        engine.setup(ModelSource(path), torch.device("cpu"))
    weights = [(name, t + 0.5 * torch.randn_like(t)) for name, t in old.model.state_dict().items()]
    new.update_weights(weights)
    tokens = lambda outputs: [o[0].token_ids for o in outputs]  # noqa: E731
    assert tokens(old.generate(prompts, greedy)) != tokens(new.generate(prompts, greedy))
    pool = WorkerPool(1, {POLICY: RoleSpec(HFEngine(), ModelSource(path))}, [POLICY])
    try:
        pool.queue_syncs = True
        in_flight = pool.submit_generate(POLICY, prompts, greedy, [0])
        pool.sync_weights(weights)  # queued behind the request in flight
        assert not in_flight[0].done  # nothing waited for it
        after = pool.submit_generate(POLICY, prompts, greedy, [0])
        assert tokens(pool.collect_generate(in_flight)) == tokens(old.generate(prompts, greedy))
        assert tokens(pool.collect_generate(after)) == tokens(new.generate(prompts, greedy))
    finally:
        pool.close()


@pytest.mark.integration
@pytest.mark.slow  # starts an engine worker process
def test_a_request_sent_while_the_worker_loads_a_sync_starts_without_waiting_for_the_controller(tmp_path):
    """At K >= 1 the controller submits the next rollout while the workers load the weight sync, then trains without
    calling the pool. The request goes to the worker behind the sync at once (not held until the controller's next
    call): its result arrives while the controller only reads the worker's pipe, and samples with the new weights."""
    from gcore.engines.hf import HFEngine
    from gcore.engines.pool import POLICY, RoleSpec, WorkerPool
    from gcore.model import ModelSource, char_tokenizer, materialize

    path = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), char_tokenizer(),
                       seed=0, workdir=str(tmp_path / "policy"))
    greedy, prompts = SamplingParams(n=1, max_new_tokens=8, temperature=0.0), [[5, 6, 7], [8, 9]]
    new = HFEngine()
    new.setup(ModelSource(path), torch.device("cpu"))
    weights = [(name, t + 0.5 * torch.randn_like(t)) for name, t in new.model.state_dict().items()]
    new.update_weights(weights)
    pool = WorkerPool(1, {POLICY: RoleSpec(HFEngine(), ModelSource(path))}, [POLICY])
    try:
        pool.queue_syncs = True
        pool.collect_generate(pool.submit_generate(POLICY, prompts, greedy, [0]))
        pool.sync_weights(weights)  # the worker is idle: the sync goes out at once
        (after,) = pool.submit_generate(POLICY, prompts, greedy, [0])
        conn = pool._conns[0]
        assert conn is not None
        for _ in range(2):  # the sync's reply, then the request's, with no call to the pool in between
            assert conn.poll(120), "the request waited for the controller's next call to the pool"
            pool._handle(conn.recv())
        assert after.done and after.ok
        assert [g[0].token_ids for g in pool.collect_generate([after])] == \
            [o[0].token_ids for o in new.generate(prompts, greedy)]
    finally:
        pool.close()


class Events:
    """What happened, in order, in the controller's thread and the thread that judges rollouts started ahead;
    ``wait_for`` holds one thread until the other has reached a point (never longer than ``timeout_s``: a
    wait that runs out is recorded, and fails the test, instead of hanging it)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.seen: list[tuple] = []
        self.timeout_s = timeout_s
        self._changed = threading.Condition()

    def mark(self, *event: object) -> None:
        with self._changed:
            self.seen.append(event)
            self._changed.notify_all()

    def wait_for(self, *event: object) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: event in self.seen, self.timeout_s):
                self.seen.append(("timed out waiting for", *event))

    def index(self, *event: object) -> int:
        return self.seen.index(event)


class GatedJudge(GenerativeReward):
    """A generative judge that records what it judged: the verdicts it gave each policy version's samples, and
    when it judged them. A rollout judged in a thread of the controller's process other than the one that trains
    (a rollout started ahead: the only way its judging can run while the controller trains) holds its last
    verdict back until the step that started it has begun training: so the test sees the judging of step
    ``s + 1``'s samples and the training of step ``s`` overlap, whatever the speed of either."""

    def __init__(self, path: str, events: Events) -> None:
        super().__init__(path, verdict="probability", batch_size=64)
        self.events = events
        self.verdicts: dict[tuple[int, bool], list[float]] = {}  # (policy version, judged ahead) -> verdicts

    def score(self, samples):
        version = samples[0].policy_version
        assert all(s.policy_version == version for s in samples)  # one rollout's samples
        ahead = threading.current_thread() is not threading.main_thread()
        self.events.mark("judge starts", version, ahead)
        scores = super().score(samples)
        self.verdicts.setdefault((version, ahead), []).extend(scores)
        if ahead:  # started ahead at step ``version``: the last verdict waits for that step's training
            self.events.wait_for("train", version)
        self.events.mark("judge ends", version, ahead)
        return scores


class GatedGRPO(RecordingGRPO):
    """GRPO that records the rewards it trains on, and whose training of step ``s`` (its first loss) waits
    until the judging of the rollout started ahead at step ``s`` has begun."""

    def __init__(self, events: Events, steps: int) -> None:
        super().__init__()
        self.events, self.steps = events, steps
        self.rewards: list[list[float]] = []
        self._training: set[int] = set()

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        self.rewards.append(batch.rewards.tolist())
        return super().advantages(batch)

    def loss(self, logprobs, batch, scale, entropy=None):
        step = len(self.rewards) - 1
        if step not in self._training:
            self._training.add(step)
            self.events.mark("train", step)
            if step < self.steps - 1:  # the last step starts nothing ahead
                self.events.wait_for("judge starts", step, True)
            self.events.mark("train goes on", step)
        return super().loss(logprobs, batch, scale, entropy)


@pytest.mark.integration
@pytest.mark.slow  # starts engine worker processes (policy and judge): ~30-60 s each
@pytest.mark.parametrize("placement", [lambda: StaticPlacement(workers=1), lambda: DynamicPlacement(workers=2)],
                         ids=["static_workers", "dynamic"])
def test_the_judging_of_a_rollout_started_ahead_overlaps_training_and_its_verdicts_are_trained(placement, tmp_path):
    """K = 1 with a generative judge (docs/asynchronous.md, the judge in the pipeline): the samples of step
    ``s + 1`` are judged while step ``s`` trains (on the judge's workers), every trained sample carries the
    judge's verdict, and dynamic placement's re-split still gets the judge's busy time."""
    from gcore.model import char_tokenizer, materialize

    judge_path = materialize(ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
                             char_tokenizer(), seed=1, workdir=str(tmp_path / "judge"))
    steps, prompts, n = 3, 2, 2
    events = Events()
    judge, algorithm, policy = GatedJudge(judge_path, events), GatedGRPO(events, steps), placement()
    telemetry: list[Telemetry] = []
    update = policy.update
    policy.update = lambda t: (telemetry.append(t), update(t))[1]
    result = Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=str(tmp_path), enable_progress_bar=False,
                              save_final=False, max_staleness=1, logger=[]),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(prompts_per_step=prompts), sampling=SamplingParams(n=n, max_new_tokens=4),
        algorithm=algorithm, placement=policy, reward=judge,
    ).fit()
    seen = events.seen
    assert not [e for e in seen if e[0] == "timed out waiting for"], seen
    for step in range(steps - 1):
        # the rollout started ahead at ``step`` (step + 1's samples, version ``step``) is judged while ``step``
        # trains: its judging begins before the training goes on and ends after the training has begun
        assert events.index("judge starts", step, True) < events.index("train goes on", step), seen
        assert events.index("train", step) < events.index("judge ends", step, True), seen
        # ... and nothing of step + 1 is judged in the controller's thread
        assert ("judge starts", step, False) not in seen or step == 0, seen
    # step 0 generates and judges its own samples now; every later step trains on the rollout started ahead
    assert [e[1:] for e in seen if e[0] == "judge starts"][0] == (0, False)
    for step, (rewards, versions) in enumerate(zip(algorithm.rewards, algorithm.versions, strict=True)):
        assert len(rewards) == prompts * n and set(versions) == {max(step - 1, 0)}, (step, versions)
        judged = judge.verdicts[(max(step - 1, 0), step > 0)]  # no sample trained unjudged: these are the verdicts
        assert sorted(rewards) == pytest.approx(sorted(judged)), (step, rewards, judged)
    history = result.history
    assert [row["async/staleness_max"] for row in history] == [0.0] + [1.0] * (steps - 1)
    assert all(row["reward/errors"] == 0 and row["time/reward"] > 0 for row in history)
    if isinstance(policy, DynamicPlacement):  # the split is decided from the judge's busy time, every step
        assert len(telemetry) == steps and all(t.busiest("reward") > 0 and t.busiest("generate") > 0
                                                for t in telemetry), telemetry
        assert all("placement/idle_judge_s" in row for row in history)


# -- resuming an asynchronous run: the rollouts in flight come back (docs/asynchronous.md, "Resume") ---------------


class InProcessPipeline(StaticPlacement):
    """The engine in the controller's process, pretending to overlap: a rollout started ahead runs when it is
    collected (``InFlight.deferred``). Deterministic, like static placement over engine workers."""

    @property
    def supports_overlap(self) -> bool:
        return True


class UnreproduciblePipeline(InProcessPipeline):
    @property
    def reproducible(self) -> bool:
        return False


class UnrecordedPipeline(InProcessPipeline):
    """Returns its rollouts started ahead with neither their generations nor ``deferred``, as a placement of
    one's own may: a checkpoint cannot record them."""

    def start_rollout(self, job: RolloutJob):
        return InFlight(lambda: self.rollout(job))


def _clock(name: str) -> bool:
    """Columns no two runs share (scripts/compare_runs.py's ``clock_column``, and the checkpoint's own)."""
    return (name.startswith(("time/", "memory/", "threads/", "checkpoint/", "placement/idle_"))
            or name.endswith(("_s", "gb_per_s")))


def _pipeline_run(root, max_staleness: int, placement=InProcessPipeline, plugins=None, **trainer):
    from safetensors.torch import load_file

    config = {"max_steps": 5, "save_final": True, "keep_checkpoints": 5, **trainer}
    result = Trainer(
        trainer=TrainerConfig(default_root_dir=str(root), enable_progress_bar=False, max_staleness=max_staleness,
                              seed=3, **config),
        model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
        data=DataConfig(prompts_per_step=3), sampling=SamplingParams(n=2, max_new_tokens=4),
        placement=placement(), **(plugins or {}),
    ).fit()
    assert result.final_model_dir is not None
    return result.history, load_file(f"{result.final_model_dir}/model.safetensors")


@pytest.fixture
def fixed_threads(monkeypatch):
    """The torch thread count held fixed, as ``OMP_NUM_THREADS`` does (no governor: docs/threads.md): a sum over
    another number of threads may differ in its last bit, and these runs compare bit for bit."""
    from gcore import threads

    monkeypatch.setattr(threads, "user_threads_at_import", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dispatch", ["device", "step"])
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_resumed_asynchronous_run_continues_exactly_with_the_engine_in_process(tmp_path, max_staleness, dispatch,
                                                                                   capsys, fixed_threads):
    """Stopped after step 1 (its checkpoint: the prompts of steps 2..1+K drawn ahead, their rollouts in flight, and
    with ``dispatch`` ``device`` step 2+K's too) and resumed: the same metrics, step for step, and the same final
    weights as the run that went on."""
    whole, weights = _pipeline_run(tmp_path, max_staleness, checkpoint_every=2, dispatch=dispatch)
    ckpt = tmp_path / "gcore" / "checkpoints" / "step_00000001"
    resumed, resumed_weights = _pipeline_run(tmp_path, max_staleness, resume=str(ckpt), dispatch=dispatch)
    assert "note" not in capsys.readouterr().out  # nothing about this resume is inexact
    assert [row["step"] for row in resumed] == [2.0, 3.0, 4.0]
    for before, after in zip(whole[2:], resumed, strict=True):
        compared = sorted(k for k in before.keys() | after.keys() if not _clock(k))
        assert {k: before.get(k) for k in compared} == {k: after.get(k) for k in compared}, before["step"]
    assert resumed[0]["async/staleness_max"] == float(min(2, max_staleness))  # collected, not generated now
    assert weights.keys() == resumed_weights.keys()
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)


class TokenSumReward(RewardModel):
    """A reward of the tokens alone (so a resumed run scores alike): a uniform group for about half the prompts."""

    def score(self, samples):
        return [0.0 if s.prompt.index % 2 else float(sum(s.response_ids) % 3) for s in samples]


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_resumed_run_that_oversamples_continues_exactly(tmp_path, max_staleness, capsys, fixed_threads):
    """``--trainer.oversample``: with K = 1 the rollouts in flight at the checkpoint hold extra prompts drawn from the
    keep rate, and the resumed run rebuilds them from their indices; with K = 0 the first step resumed draws its
    extra prompts from the keep rate recorded. Either way its metrics and weights are the uninterrupted run's."""
    from gcore.algorithms.dapo import DAPO

    def run(**trainer):
        plugins = {"algorithm": DAPO(max_rounds=4), "reward": TokenSumReward()}
        return _pipeline_run(tmp_path, max_staleness, plugins=plugins, oversample=True, **trainer)

    whole, weights = run(checkpoint_every=2)
    assert any(m["filter/groups_sampled"] > 3 and m["filter/rounds_max"] == 1 for m in whole[1:])  # drawn up front
    resumed, resumed_weights = run(resume=str(tmp_path / "gcore" / "checkpoints" / "step_00000001"))
    assert "note" not in capsys.readouterr().out
    for before, after in zip(whole[2:], resumed, strict=True):
        compared = sorted(k for k in before.keys() | after.keys() if not _clock(k))
        assert {k: before.get(k) for k in compared} == {k: after.get(k) for k in compared}, before["step"]
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)


def test_a_resume_that_cannot_be_exact_says_so_in_one_line(tmp_path, capsys):
    """A run resumed from its last step had nothing in flight; a placement that is not reproducible continues
    the rollouts in flight but not exactly: each is one note when the run resumes."""
    _pipeline_run(tmp_path / "a", 1, max_steps=2, checkpoint_every=2, save_final=True)
    capsys.readouterr()
    _pipeline_run(tmp_path / "a", 1, max_steps=3, resume="auto")
    notes = [line for line in capsys.readouterr().out.splitlines() if "note" in line]
    assert len(notes) == 1 and "written at the last step of its run" in notes[0], notes
    _pipeline_run(tmp_path / "b", 1, max_steps=3, checkpoint_every=2, placement=UnreproduciblePipeline)
    capsys.readouterr()
    _pipeline_run(tmp_path / "b", 1, max_steps=3, resume=str(tmp_path / "b" / "gcore" / "checkpoints" /
                                                               "step_00000001"), placement=UnreproduciblePipeline)
    notes = [line for line in capsys.readouterr().out.splitlines() if "note" in line]
    assert len(notes) == 1 and "not an exact continuation" in notes[0], notes
    _pipeline_run(tmp_path / "c", 2, max_steps=4, checkpoint_every=2, placement=UnrecordedPipeline)
    capsys.readouterr()
    history, _ = _pipeline_run(tmp_path / "c", 2, max_steps=4, placement=UnrecordedPipeline,
                               resume=str(tmp_path / "c" / "gcore" / "checkpoints" / "step_00000001"))
    notes = [line for line in capsys.readouterr().out.splitlines() if "note" in line]
    assert len(notes) == 1 and "2 rollout(s) in flight at the checkpoint could not be recorded" in notes[0], notes
    # the same prompts, generated again with the weights resumed: step 2 now (fresh), step 3 started ahead by step 2
    assert [row["async/staleness_max"] for row in history] == [0.0, 1.0]
    assert all(row["samples/trained"] == 6.0 for row in history)


def test_the_recorded_generations_come_back_as_they_were_through_a_weights_only_file(tmp_path):
    from gcore.inflight import pack, unpack
    from gcore.types import Generation

    outputs = [[Generation([5, 6, 7], [-0.1, -1e-9, -3.25], True), Generation([], [], False)],
               [Generation([9], [-0.30000000000000004], False)]]
    torch.save({"rollouts": [pack(outputs)]}, tmp_path / "rank_0.pt")
    loaded = torch.load(tmp_path / "rank_0.pt", weights_only=True)["rollouts"][0]
    assert unpack(loaded) == outputs


# -- when a rollout started ahead goes out (--trainer.dispatch) ---------------------------------------------------


class RecordingPipeline(InProcessPipeline):
    """Records, in order, each rollout started ahead (``start``) and collected (``collect``), with the policy version
    it was started with."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def start_rollout(self, job: RolloutJob):
        self.events.append(("start", job.policy_version))
        result = super().start_rollout(job)

        def collect():
            self.events.append(("collect", job.policy_version))
            return result()

        return InFlight(collect)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_device_dispatch_starts_a_rollout_as_soon_as_its_weights_exist_step_dispatch_after_the_rollout_before_it(
        tmp_path, max_staleness):
    """With ``device`` the rollout of step s+K+1 starts right after step s's weight sync (version s+1), before step
    s+1 collects its own rollout; with ``step`` only after it. Either way it starts with version s+1, so a sample
    is never more than K versions old, and each step collects the rollout started for it."""
    events = {}
    for dispatch in ("device", "step"):
        placement = RecordingPipeline()
        result = Trainer(
            trainer=TrainerConfig(max_steps=5, default_root_dir=str(tmp_path / dispatch), enable_progress_bar=False,
                                  save_final=False, logger=[], max_staleness=max_staleness, dispatch=dispatch),
            model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
            data=DataConfig(prompts_per_step=2), sampling=SamplingParams(n=2, max_new_tokens=4),
            placement=placement,
        ).fit()
        assert all(row["async/staleness_max"] <= max_staleness for row in result.history)
        events[dispatch] = placement.events
    k = max_staleness
    # steps 1..K start with version 0 before step 0 trains; step s + K + 1 with version s + 1 (s = 0, 1, 2 of 5 steps)
    starts = [0] * k + [1, 2, 3][: 5 - 1 - k]
    for dispatch in ("device", "step"):
        assert [v for kind, v in events[dispatch] if kind == "start"] == starts, dispatch
        assert [v for kind, v in events[dispatch] if kind == "collect"] == [0] * k + [1, 2, 3][: 4 - k]
    # version 1 (after step 0) starts step K+1: under device before step 1 collects (version 0's first rollout)
    first_collect = events["device"].index(("collect", 0))
    assert events["device"].index(("start", 1)) < first_collect
    assert events["step"].index(("start", 1)) > events["step"].index(("collect", 0))


@pytest.mark.integration
@pytest.mark.slow  # starts two engine worker processes per run: ~30-60 s each
def test_device_and_step_dispatch_train_on_the_same_samples_over_engine_workers(tmp_path):
    """Over two static engine workers, each rollout samples from its own seed with the weights it was started with,
    and both dispatches start it with the same version: the runs are the same, metric for metric and weight for
    weight; only when the generation ran differs."""
    from safetensors.torch import load_file

    runs = {}
    for dispatch in ("device", "step"):
        result = Trainer(
            trainer=TrainerConfig(max_steps=4, default_root_dir=str(tmp_path / dispatch), enable_progress_bar=False,
                                  seed=5, max_staleness=1, dispatch=dispatch),
            model=ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64),
            data=DataConfig(prompts_per_step=4), sampling=SamplingParams(n=4, max_new_tokens=6),
            placement=StaticPlacement(workers=2, threads=1),
        ).fit()
        assert result.final_model_dir is not None
        runs[dispatch] = (result.history, load_file(f"{result.final_model_dir}/model.safetensors"))
    (device, device_weights), (step, step_weights) = runs["device"], runs["step"]
    for a, b in zip(device, step, strict=True):
        compared = sorted(key for key in a.keys() | b.keys() if not _clock(key))
        assert {key: a.get(key) for key in compared} == {key: b.get(key) for key in compared}, a["step"]
    assert all(torch.equal(device_weights[key], step_weights[key]) for key in device_weights)
