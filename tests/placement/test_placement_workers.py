"""Engine worker processes: shared-memory weight sync, real swaps, faults, and dynamic placement in the trainer."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from conftest import local_engine, pool_models

from gcore.engines.hf import HFEngine
from gcore.engines.pool import JUDGE, POLICY, PoolEngine, RoleSpec, WorkerPool
from gcore.errors import ConfigError, GcoreError, RewardError
from gcore.model import ModelSource
from gcore.placement.base import Telemetry
from gcore.placement.dynamic import DynamicPlacement
from gcore.placement.static import StaticPlacement
from gcore.rewards.generative import GenerativeReward
from gcore.rewards.rule import CallableReward
from gcore.testing import make_sample, tiny_fit
from gcore.types import SamplingParams

GREEDY = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return pool_models(tmp_path_factory.mktemp("models"))


def tokens(outputs):
    return [o[0].token_ids for o in outputs]


def test_placement_that_cannot_fit_fails_before_work(models):
    _, judge_path = models
    with pytest.raises(ConfigError, match="at least 2 devices"):
        DynamicPlacement(workers=1).setup(1, "cpu", GenerativeReward(judge_path))
    with pytest.raises(ConfigError, match="a CUDA GPU or in `gcore simulate`, not on mps"):
        DynamicPlacement(workers=4).setup(1, "mps")
    with pytest.raises(ConfigError, match="at least 2 devices"):  # in Trainer.fit, before any worker starts
        tiny_fit(steps=1, reward=GenerativeReward(judge_path), placement=DynamicPlacement(workers=1))


@pytest.mark.integration
def test_invalid_dynamic_placement_is_refused_once_before_the_controllers_start(models, gcore_cli, tmp_path):
    _, judge_path = models
    result = gcore_cli("--trainer.devices", "2", "--trainer.accelerator", "cpu", "--placement", "dynamic",
                       "--placement.workers", "1", "--reward", "generative", "--reward.path", judge_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [(
        "gcore: error: --placement dynamic with a generative judge needs at least 2 devices (one for generation, "
        "one for the judge), got 1; give --placement.workers 2 or use --placement static")]
    assert not list(tmp_path.rglob("metrics.csv"))  # no controller ran


SCORED_BY = """
import os
def score(prompt, response, answer):
    with open(os.path.join(os.path.dirname(__file__), "scored-by.txt"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    return float(response.count(answer[0])) / 6
"""


class RecordedStageTimes(DynamicPlacement):
    """Dynamic placement fed recorded stage times instead of this machine's: its decisions are exact."""

    def __init__(self, recorded: list[tuple[float, float, float]], **kwargs) -> None:
        super().__init__(**kwargs)
        self.recorded = recorded

    def update(self, telemetry):
        generate, reward, rollout = self.recorded[telemetry.step]
        return super().update(Telemetry(telemetry.step, [{"generate": generate, "reward": reward, "rollout": rollout}]))


@pytest.mark.integration
@pytest.mark.slow
def test_dynamic_moves_a_worker_to_a_rule_reward_and_back_from_recorded_stage_times(tmp_path):
    """The policy's decisions are made real: the moved worker swaps to the reward and scores the samples."""
    (tmp_path / "scored.py").write_text(SCORED_BY)
    # the recorded times of tests/placement/test_placement.py: stay, move a worker to the reward, stay, move it back
    recorded = [(1.0, 0.01, 1.02), (1.0, 1.5, 2.5), (2.0, 1.5, 2.1), (2.0, 0.05, 2.0), (1.0, 0.01, 1.02)]
    placement = RecordedStageTimes(recorded, workers=2)
    scored_by = tmp_path / "scored-by.txt"  # the pid of the process that scored each sample
    history = tiny_fit(steps=len(recorded), reward=CallableReward(f"{tmp_path / 'scored.py'}:score"),
                       placement=placement).history
    assert [int(m["placement/judge_devices"]) for m in history] == [0, 1, 1, 0, 0]
    assert [int(m["placement/moved"]) for m in history] == [0, 1, 0, -1, 0]
    # steps 2 and 3 ran with worker 1 on the reward: it swapped engines once each way
    assert history[2]["time/swap"] > 0 and history[4]["time/swap"] > 0 and placement.pool.swaps == 2
    assert placement.pool.roles == [POLICY, POLICY]
    pids = [int(line) for line in scored_by.read_text().split()]
    per_step = len(pids) // len(recorded)
    by_step = [set(pids[i * per_step : (i + 1) * per_step]) for i in range(len(recorded))]
    here = os.getpid()
    assert by_step[0] == by_step[1] == by_step[4] == {here}  # scored in the controller
    assert by_step[2] == by_step[3] and here not in by_step[2]  # scored in the reward worker process
    for m in history:
        assert m["reward/errors"] == 0 and m["samples/total"] == per_step


@pytest.mark.integration
@pytest.mark.slow
def test_pool_syncs_weights_and_survives_dead_and_hung_workers(models):
    policy_path, judge_path = models
    prompts = [[5, 6, 7], [8, 9]]
    specs = {POLICY: RoleSpec(HFEngine(), ModelSource(policy_path)),
             JUDGE: RoleSpec(HFEngine(), ModelSource(judge_path))}
    pool = WorkerPool(3, specs, [POLICY, JUDGE, JUDGE], retries=1)
    try:
        # weight sync through shared memory: the worker samples exactly as an engine holding the new weights
        reference = local_engine(policy_path)
        new = [(name, t + 0.05 * torch.randn_like(t)) for name, t in reference.model.state_dict().items()
               if name != "lm_head.weight"]
        sync = pool.sync_weights(new)
        reference.update_weights(new)
        assert sync["bytes"] == sync["shm_bytes"] > 0 and sync["s"] > 0
        assert tokens(pool.generate(POLICY, prompts, GREEDY, [0])) == tokens(reference.generate(prompts, GREEDY))

        judge = local_engine(judge_path)
        expected = tokens(judge.generate(prompts, GREEDY))
        # next-token log-probabilities (the judge's probability verdict) split over the judge workers, in order
        rows = PoolEngine(pool, JUDGE, [1, 2]).next_token_logprobs(prompts, [5, 6, 7])
        assert torch.allclose(torch.tensor(rows), torch.tensor(judge.next_token_logprobs(prompts, [5, 6, 7])))
        # a judge worker killed in the middle of a request: the request is served by another worker
        os.kill(pool.processes[1].pid, signal.SIGSTOP)
        job = pool.submit("generate", (JUDGE, prompts, GREEDY), [1, 2], JUDGE)
        assert job.worker == 1
        os.kill(pool.processes[1].pid, signal.SIGKILL)
        pool.wait([job])
        assert tokens(job.result) == expected and job.worker == 2 and pool.retried == 1

        # a hung judge worker (its only peer is dead): killed at the timeout, both respawned, request retried
        pool.job_timeout_s = 3.0
        os.kill(pool.processes[2].pid, signal.SIGSTOP)
        job = pool.submit("generate", (JUDGE, prompts, GREEDY), [1, 2], JUDGE)
        pool.wait([job])
        assert tokens(job.result) == expected and pool.retried == 2 and pool.respawned == 2
        assert "did not answer within job_timeout_s" in job.errors[0]
        # a respawned worker holding the policy takes the latest weights from shared memory
        pool.assign([POLICY, POLICY, JUDGE])
        assert tokens(pool.generate(POLICY, prompts, GREEDY, [1])) == tokens(reference.generate(prompts, GREEDY))

        # no attempts left: the step fails, and no sample gets a reward it was not given
        pool.retries = 0
        reward = GenerativeReward(judge_path, engine=PoolEngine(pool, JUDGE, [2]), verdict="yes_no", max_new_tokens=4,
                                  retries=0)
        reward.setup("cpu")
        os.kill(pool.processes[2].pid, signal.SIGSTOP)
        samples = [make_sample("q", "r1", "1"), make_sample("q", "r2", "2")]
        with pytest.raises(RewardError, match=r"(?s)failed 1 times.*job_timeout_s.*no reward was given"):
            reward.score(samples)
        assert all(s.reward == 0.0 and not s.reward_info for s in samples)
        with pytest.raises(GcoreError, match="no engine worker"):
            pool.submit("generate", (JUDGE, prompts, GREEDY), [], JUDGE)
    finally:
        pool.close()
    assert not any(p.is_alive() for p in pool.processes) and not os.path.exists(pool.weights.path)


def test_a_close_cut_short_leaves_no_weights_in_shared_memory(models, monkeypatch):
    # before: the file was removed after the workers were joined, and a Ctrl-C during the joins (a worker whose
    # engine is slow to stop, as SGLang's) left it in /dev/shm
    policy_path, _ = models
    pool = WorkerPool(1, {POLICY: RoleSpec(HFEngine(), ModelSource(policy_path))}, [POLICY], threads=1)
    process = pool.processes[0]
    try:
        pool.sync_weights(local_engine(policy_path).model.named_parameters())
        assert os.path.exists(pool.weights.path)

        def interrupted(timeout=None):
            raise KeyboardInterrupt

        monkeypatch.setattr(process, "join", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.close()
        assert not os.path.exists(pool.weights.path)
    finally:
        monkeypatch.undo()
        process.kill()
        process.join(timeout=10)


def _share_one_pool(fabric, policy_path: str, judge_path: str, out: str) -> None:
    """In each of two controllers: connect to the machine's one pool, take synced weights, lose and get back a
    worker, swap a role."""
    from gcore.engines.pool import Peers

    peers = Peers.of_this_machine()
    specs = {POLICY: RoleSpec(HFEngine(), ModelSource(policy_path)),
             JUDGE: RoleSpec(HFEngine(), ModelSource(judge_path))}
    pool = WorkerPool(2, specs, [POLICY, POLICY], threads=1, peers=peers)
    prompts = [[5, 6, 7], [8, 9]]
    reference = local_engine(policy_path)
    torch.manual_seed(0)  # the same new weights in both controllers, as after a data-parallel step
    new = [(name, t + 0.05 * torch.randn_like(t)) for name, t in reference.model.state_dict().items()
           if name != "lm_head.weight"]
    sync = pool.sync_weights(new)
    reference.update_weights(new)
    expected = tokens(reference.generate(prompts, GREEDY))
    result = {"owner": pool.owner, "started": [p is not None for p in pool.processes], "sync_bytes": sync["bytes"],
              "synced": [tokens(pool.generate(POLICY, prompts, GREEDY, [i])) == expected for i in (0, 1)]}
    fabric.barrier()
    if pool.owner:  # a worker dies between steps: the next step's revive restarts it for both controllers
        os.kill(pool.processes[1].pid, signal.SIGKILL)
        pool.processes[1].join(timeout=10)
    fabric.barrier()
    result["revived"] = pool.revive()
    result["after_revive"] = tokens(pool.generate(POLICY, prompts, GREEDY, [1])) == expected
    fabric.barrier()  # in the trainer the split changes where every controller has finished its rollout
    pool.assign([POLICY, JUDGE])  # both controllers ask; the worker swaps once
    result["judge"] = tokens(pool.generate(JUDGE, prompts, GREEDY, [1])) == tokens(
        local_engine(judge_path).generate(prompts, GREEDY))
    fabric.barrier()
    pool.close()
    torch.save(result, out % fabric.global_rank)


@pytest.mark.integration
@pytest.mark.slow
def test_two_controllers_share_one_pool_of_workers(models, tmp_path):
    """One pool per machine: the first controller starts the workers, both send them requests, the weights the
    owner syncs reach the other controller's requests, and a lost worker is restarted for both."""
    from datetime import timedelta

    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    policy_path, judge_path = models
    out = str(tmp_path / "rank%d.pt")
    strategy = DDPStrategy(start_method="spawn", timeout=timedelta(seconds=300))
    Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(_share_one_pool, policy_path, judge_path, out)
    owner, other = torch.load(out % 0), torch.load(out % 1)
    assert owner["owner"] and not other["owner"]
    assert owner["started"] == [True, True] and other["started"] == [False, False]  # no second pool
    assert owner["sync_bytes"] > 0 and other["sync_bytes"] == 0  # the owner sent the weights for both
    for result in (owner, other):
        assert result["synced"] == [True, True] and result["after_revive"] and result["judge"], result
        assert result["revived"] == 1


@pytest.mark.integration
@pytest.mark.slow
def test_static_swaps_policy_and_judge_on_every_worker(models):
    _, judge_path = models
    placement = StaticPlacement(workers=2)
    reward = GenerativeReward(judge_path, verdict="yes_no", max_new_tokens=4, batch_size=64)
    history = tiny_fit(steps=2, reward=reward, placement=placement).history
    pool = placement.pool
    assert pool.swaps == 2 * 2 * 2  # policy -> judge -> policy on 2 workers, for 2 steps
    assert pool.held == [(POLICY,), (POLICY,)]  # the judge was released, not kept beside the policy
    for metrics in history:
        assert metrics["time/swap"] > 0 and metrics["time/reward"] > 0
        assert metrics["reward/errors"] == metrics["samples/total"]  # a random judge: every verdict unparsable
        assert metrics["sync/gb"] > 0


class JudgeCostSchedule(DynamicPlacement):
    """Dynamic placement whose judge writes ``lengths[step]`` tokens per verdict: its cost rises, then falls."""

    def __init__(self, lengths: list[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.lengths, self.steps = lengths, 0

    def rollout(self, job):
        job.reward.params.max_new_tokens = self.lengths[min(self.steps, len(self.lengths) - 1)]
        self.steps += 1
        return super().rollout(job)


@pytest.mark.integration
@pytest.mark.slow
def test_dynamic_moves_a_worker_to_the_judge_when_its_cost_rises(models):
    """The one test of dynamic placement on this machine's own timings (the exact decisions are tested on
    recorded stage times above): a judge writing 64 tokens per verdict instead of 1 costs so much more that
    a worker moves to it, however loaded the machine. Whether it moves back in time is not asserted: that
    depends on how the machine's load changes between steps."""
    _, judge_path = models
    lengths = [1, 64, 64, 64]
    placement = JudgeCostSchedule(lengths, workers=3, judge_fraction=0.34, min_fraction=0.3)
    reward = GenerativeReward(judge_path, verdict="yes_no", max_new_tokens=1, batch_size=64)
    history = tiny_fit(steps=len(lengths), reward=reward, placement=placement).history
    judges = [int(m["placement/judge_devices"]) for m in history]  # the split decided after each step
    assert 2 in judges[1:], judges  # a worker moved to the judge after an expensive step
    rise = judges.index(2)
    if rise + 1 < len(history):
        assert history[rise + 1]["time/swap"] > 0  # the moved worker swapped engines
    for m in history:
        assert m["time/rollout"] > 0 and m["time/idle_generate"] >= 0 and m["time/idle_reward"] >= -0.05


@pytest.mark.integration
@pytest.mark.slow
def test_fit_cli_dynamic_placement_with_generative_judge(models, gcore_cli, tmp_path):
    import csv

    _, judge_path = models
    result = gcore_cli("--placement", "dynamic", "--placement.workers", "2", "--reward", "generative",
                       "--reward.path", judge_path, "--reward.verdict", "yes_no", "--reward.max_new_tokens", "4",
                       timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 engine worker processes, 1 generating and 1 judging at once" in result.stdout
    metrics = next((tmp_path / "runs").rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("placement/judge_devices")]
    assert len(rows) == 2  # FAST: 2 steps
    for r in rows:
        # with 2 devices the split cannot move (each partition keeps one), and the judge ran on its worker:
        # a random judge's verdicts cannot be parsed, so every sample counts as a reward error
        assert (float(r["placement/generate_devices"]), float(r["placement/judge_devices"])) == (1.0, 1.0)
        assert float(r["placement/moved"]) == 0
        assert float(r["time/rollout"]) > 0 and float(r["time/reward"]) > 0
        assert float(r["reward/errors"]) == float(r["samples/total"]) == 8


@pytest.mark.integration
@pytest.mark.slow
def test_fit_cli_dynamic_placement_with_defaults(gcore_cli, tmp_path):
    """`gcore fit --placement dynamic` with the rule-based default reward: one engine worker per usable core
    generates, the reward is scored in the controller, and the line says so."""
    import csv

    from gcore.placement.dynamic import usable_cores

    result = gcore_cli("--placement", "dynamic", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    cores = usable_cores()
    line = [text for text in result.stdout.splitlines() if text.startswith("dynamic placement:")]
    assert len(line) == 1 and f"{cores} engine worker process{'es' if cores != 1 else ''} (" in line[0]
    assert "the reward scores in the controller" in line[0] and "nothing moves" in line[0]  # and says why
    rows = [r for r in csv.DictReader(next((tmp_path / "runs").rglob("metrics.csv")).open())
            if r.get("placement/judge_devices")]
    assert len(rows) == 2
    for r in rows:
        assert (float(r["placement/generate_devices"]), float(r["placement/judge_devices"])) == (cores, 0.0)
        assert float(r["time/generate"]) > 0 and float(r["reward/errors"]) == 0 and float(r["samples/total"]) == 8


@pytest.mark.integration
@pytest.mark.slow
def test_two_controllers_move_shared_workers_to_the_judge_as_its_share_grows(models, gcore_cli, tmp_path):
    """End to end: two controllers on one machine share one pool of 4 workers; the prompts' judged share rises
    from 0 to 1 over the run (``mixed`` task, routed reward), and the split follows it to the judge.

    The judge is a random tiny model (its verdicts never parse: this shows the placement, not the judge's
    quality) asked one sample at a time for 48 tokens, so that its work grows with the judged share from
    nothing to about 20x the generation's."""
    import csv
    import json

    _, judge_path = models
    judge = {"class_path": "gcore.rewards.generative.GenerativeReward",
             "init_args": {"path": judge_path, "batch_size": 1, "max_new_tokens": 48, "verdict": "yes_no"}}
    routes = json.dumps({"class_path": "gcore.rewards.routed.RoutedReward", "init_args": {"routes": {
        "math": {"class_path": "gcore.rewards.math.MathReward"}, "judge": judge}}})
    result = gcore_cli("--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.max_steps", "8",
                       "--data.task", "mixed", "--data.task_judged_share", "[0, 1]", "--data.shuffle", "false",
                       "--data.num_synthetic_prompts", "32", "--data.prompts_per_step", "4", "--sampling.n", "4",
                       "--sampling.max_new_tokens", "8", "--reward", routes, "--placement", "dynamic",
                       "--placement.workers", "4", "--placement.min_fraction", "0.25", timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 engine worker processes shared by the machine's controllers" in result.stdout
    rows = list(csv.DictReader(next((tmp_path / "runs").rglob("metrics.csv")).open()))
    judges = [float(r["placement/judge_devices"]) for r in rows]
    assert len(judges) == 8
    assert all(float(r["placement/generate_devices"]) + j == 4 for r, j in zip(rows, judges, strict=True))
    assert judges[0] == 1 and judges[-1] >= 2, judges  # the judge got more of the pool as its work grew
