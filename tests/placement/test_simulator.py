"""The simulator's asynchronous model: bounded staleness K and partial rollouts (gcore/simulator/)."""

from __future__ import annotations

import math
import random

import pytest

from gcore.errors import ConfigError
from gcore.inflight import prompts_to_draw
from gcore.placement import DynamicPlacement, StaticPlacement
from gcore.simulator.asynchronous import draw_batches, serve_cut, simulate_async
from gcore.simulator.calibration import ASYNC_METRICS, MeasuredRun, fit_async, predict_async
from gcore.simulator.cli import run_all
from gcore.simulator.model import (
    Workload,
    compare,
    generation_costs,
    keep_rounds,
    keep_seed,
    resample_share,
    serve,
    simulate,
    summarize,
)


def _work(**overrides) -> Workload:
    base = dict(
        samples_per_device=8, median_tokens=100, max_tokens=1024, sigma=0.9, judge_output_tokens=32, swap_s=1.0,
        context_token_s=1e-5, resample_fraction=0.25,
    )
    return Workload(**{**base, **overrides})


def test_k0_is_the_synchronous_loop_unchanged():
    """K=0 runs ``model.simulate`` itself: the rows are equal field by field to the synchronous ones, and
    the first step of a small run keeps the values it had before the simulator moved (recorded from
    gcore/placement/simulator.py at main 73e42b2; the whole 50-step tables were compared bit-equal too)."""
    work = _work()
    runs = run_all(16, 3, work, {}, seed=1, max_staleness=0)
    again = compare(16, 3, work, {}, seed=1)
    assert list(runs) == ["static", "dynamic", "dynamic+release"]
    assert runs == again
    first = simulate(StaticPlacement(offload=True), 16, 1, work, seed=1)[0]
    assert (first.step_s, first.idle["generate"]) == (56.22679000000001, 495.49815)


@pytest.mark.parametrize("sigma", [0.3, 0.9, 1.3])
def test_k1_never_idles_more_than_k0(sigma):
    """Short, long and very long tails over 6 steps: overlapping generation with training does not
    add idle time when each device runs ahead on its own (``device`` dispatch), nor with the trainer's
    dispatch, with or without partial rollouts. (Over 3 steps it can: the pipeline fills in the first and drains in the
    last, docs/simulator.md.)"""
    work = _work(sigma=sigma)
    for dispatch, row in (("device", "dynamic K=1"), ("step", "dynamic K=1"), ("step", "dynamic K=1 partial")):
        runs = run_all(16, 6, work, {}, release_tail=False, max_staleness=1, partial=True, dispatch=dispatch)
        idle = {name: summarize(results, 16)["idle_device_hours"] for name, results in runs.items()}
        assert idle[row] <= idle["dynamic"], dispatch


@pytest.mark.parametrize("dispatch", ["step", "device"])
@pytest.mark.parametrize(("k", "partial"), [(1, False), (1, True), (2, False), (2, True)])
def test_staleness_never_exceeds_k_and_reaches_it(k, partial, dispatch):
    work = _work()
    results = simulate_async(DynamicPlacement(), 16, 8, work, seed=2, max_staleness=k, partial=partial,
                             dispatch=dispatch)
    seen = {age for r in results for age, count in r.staleness.items() if count}
    assert max(seen) <= k
    assert k in seen  # the bound is used, so the test could fail
    assert min(seen) >= 0
    # per token: never older than the sample's first token, and every trained token is counted once
    assert all(0 <= age <= k for r in results for age in r.token_staleness)
    for r in results:
        assert max(r.token_staleness) <= max(r.staleness)
        assert sum(r.token_staleness.values()) >= sum(r.staleness.values())  # every sample has a token
    assert (sum(r.cut for r in results) > 0) == partial


def test_partial_rollouts_cut_exactly_when_the_weights_arrive():
    """4 devices (1 trains, 2 generate, 1 judges), 2 responses of 10 tokens per generation device at 1 s a
    decode step, a 1 s verdict, training 2.5 s, a weight load 0.5 s, K=1 with the trainer's dispatch.
    Batch 0: generated 0-10, judged by 11, trained 11-13.5. Batch 1 goes out when step 0 starts training
    (11) with version 0; version 1 arrives at 13.5, in the decode step 13-14: the responses stop at 14
    after 3 tokens, load 14-14.5, and do their other 7 tokens with version 1 by 21.5; judged 22.5, trained
    22.5-25. Batch 2 goes out at 22.5 with version 1; version 2 arrives at 25 in the step 24.5-25.5: cut at
    25.5 after 3 tokens, load to 26, done at 33, judged 34, trained 34-36.5. No token budget: without the
    update nothing is cut (step 0), and the cut is at the arrival, not after a number of tokens."""
    work = Workload(
        samples_per_device=1, prompt_tokens=0, median_tokens=10, sigma=0.0, max_tokens=100, length_drift=0.0,
        decode_step_s=1.0, generate_token_s=0.0, judge_token_s=0.0, judge_generate_token_s=0.0,
        judge_output_tokens=1, judge_decode_step_s=1.0, swap_s=0.5, train_token_s=0.0, train_step_s=2.5,
    )
    results = simulate_async(DynamicPlacement(hysteresis=1e9), 4, 3, work, max_staleness=1, partial=True,
                             train_devices=1)
    assert [(r.train_devices, r.generate_devices, r.judge_devices) for r in results] == [(1, 2, 1)] * 3
    assert [r.step_s for r in results] == [13.5, 11.5, 11.5]
    assert [r.cut for r in results] == [0, 4, 4]
    assert [r.staleness for r in results] == [{0: 4}, {1: 4}, {1: 4}]
    assert [r.token_staleness for r in results] == [{0: 40}, {1: 12, 0: 28}, {1: 12, 0: 28}]
    assert [r.longest_segment for r in results] == [10, 7, 7]
    # step 1 (13.5-25): each generation device decodes 13.5-14, 14.5-21.5 and (batch 2) 22.5-25, loads 14-14.5
    assert results[1].busy["generate"] == pytest.approx(2 * 10.0) and results[1].idle["swap"] == pytest.approx(1.0)
    # the same run without partial rollouts cuts nothing: every response is one segment of 10 tokens
    plain = simulate_async(DynamicPlacement(hysteresis=1e9), 4, 3, work, max_staleness=1, train_devices=1)
    assert [r.cut for r in plain] == [0, 0, 0] and [r.longest_segment for r in plain] == [10, 10, 10]


def test_a_request_sent_during_a_weight_load_starts_when_the_load_ends():
    """As the trainer's pool does (a request goes to a worker behind the weight sync it loads): with a 2 s weight
    load still running when batch 2 goes out (at 22, when step 1 starts training), batch 2 starts when the load
    ends (23), not when step 1 has trained (24.5, the pool before it sent requests behind a sync)."""
    work = Workload(
        samples_per_device=1, prompt_tokens=0, median_tokens=10, sigma=0.0, max_tokens=100, length_drift=0.0,
        decode_step_s=1.0, generate_token_s=0.0, judge_token_s=0.0, judge_generate_token_s=0.0,
        judge_output_tokens=1, judge_decode_step_s=1.0, swap_s=2.0, train_token_s=0.0, train_step_s=2.5,
    )
    # batch 0: 0-10, judged 11, trained 11-13.5; batch 1 out at 11: 11-21, judged 22, trained 22-24.5; the
    # device loads version 1 from 21 (behind its share) to 23; batch 2 out at 22, generated 23-33, judged 34,
    # trained 34-36.5
    trainer = simulate_async(DynamicPlacement(hysteresis=1e9), 4, 3, work, max_staleness=1, train_devices=1)
    assert [r.step_s for r in trainer] == [13.5, 11.0, 12.0]


def test_serve_cut_is_serve_without_a_deadline_and_stops_at_a_step_boundary():
    rng = random.Random(3)
    steps, prefill = [rng.randint(1, 200) for _ in range(11)], [rng.randint(0, 40) for _ in range(11)]
    for batching in ("continuous", "static"):
        costs = generation_costs(_work(max_batch=4, batching=batching, prefill_token_s=1e-4))
        finish, busy = serve([0.0] * 11, steps, prefill, costs)
        cut_finish, progress, end = serve_cut(steps, prefill, costs)
        assert (cut_finish, progress, end) == (finish, steps, busy)
        deadline = busy / 3
        cut_finish, progress, end = serve_cut(steps, prefill, costs, deadline)
        assert deadline <= end < busy and 0 < sum(progress) < sum(steps)
        assert all(p <= n for p, n in zip(progress, steps, strict=True))
        # finished requests did every step; the others stopped within one decode step of the deadline
        assert all((f is not None) == (p == n) for f, p, n in zip(cut_finish, progress, steps, strict=True))
        one_step = costs.step_s + costs.token_s * 4 + costs.context_token_s * (4 * (200 + 40) + 4)
        assert end - deadline <= one_step


def test_async_fit_recovers_known_costs():
    """Synthetic runs made from known costs: the fit gives them back (no timing)."""
    decode, controller, load = 0.004, 0.5, 0.006
    median, sigma = 40.0, 0.8
    from statistics import NormalDist

    unit, cap = NormalDist(), 64
    z = (math.log(cap) - math.log(median)) / sigma
    mean = median * math.exp(sigma**2 / 2) * unit.cdf(z - sigma) + cap * (1 - unit.cdf(z))
    truncated = 1 - unit.cdf(z)
    runs = []
    for label, gen_steps in (("0", [64.0, 60.0, 64.0, 50.0]), ("1", [64.0, 64.0, 62.0, 64.0])):
        busy = [decode * n for n in gen_steps]
        step = [controller + b for b in busy]
        metrics = {name: [math.nan] * 4 for name in ASYNC_METRICS}
        metrics.update({
            "time/step": step, "time/generate": busy, "time/rollout": busy, "time/reward": [0.0] * 4,
            "time/idle_generate": [0.0] * 4, "async/rollout_wait_s": busy, "time/sync": [load] * 4,
            "response_length/max": gen_steps, "response_length/mean": [mean] * 4,
            "response/truncated_frac": [truncated] * 4, "samples/total": [128.0] * 4,
        })
        runs.append(MeasuredRun(label, 7, 2, cap, metrics, warmup=0))
    costs = fit_async(runs)
    assert costs["decode_step_s"] == pytest.approx(decode)
    assert costs["train_step_s"] == pytest.approx(controller)
    assert costs["swap_s"] == pytest.approx(load)
    assert costs["median_tokens"] == pytest.approx(median, rel=0.05)
    assert costs["sigma"] == pytest.approx(sigma, abs=0.02)
    predicted = predict_async(costs, runs[0])  # K = 0, generation never overlaps the controller
    assert 0 < predicted["idle"] < 1 and predicted["cut"] == 0


def test_the_shipped_async_measurements_check_runs():
    """examples/simulate/async_tiny_measurements.json: every run predicts, within its own label's K bound."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "simulate", "async_tiny_measurements.json")
    with open(path) as f:
        runs = [MeasuredRun(**r) for r in json.load(f)["runs"]]
    assert {r.label for r in runs} == {"0", "1", "1p", "2", "2p"}
    costs = fit_async([r for r in runs if r.label in ("0", "1")])
    for r in runs[:5]:
        assert 0.0 < predict_async(costs, r)["idle"] < 1.0


def test_async_busy_and_idle_account_for_every_device_second():
    for partial in (False, True):
        results = simulate_async(DynamicPlacement(), 16, 5, _work(), max_staleness=1, partial=partial)
        for r in results:
            assert sum(r.busy.values()) + sum(r.idle.values()) == pytest.approx(16 * r.step_s)
            assert all(v >= -1e-9 for v in r.idle.values()), r.idle  # no device is booked twice
            assert r.train_devices >= 1 and r.generate_devices + r.judge_devices + r.train_devices == 16


def test_generation_of_the_next_step_overlaps_training():
    """Equal lengths, no judge cost to speak of: with K=1 the generation devices start the next batch
    while the current one trains, so a step takes less than generation plus training."""
    work = _work(sigma=0.0, resample_fraction=0.0, judge_output_tokens=1, train_token_s=0.002)
    sync = simulate_async(DynamicPlacement(), 16, 4, work, max_staleness=1, dispatch="device")
    last = sync[-1]
    assert last.step_s < last.stages["generate"] + last.stages["train"]
    assert last.staleness == {1: sum(last.staleness.values())}  # every sample from the weights one step back


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-staleness", "-1"], "--max-staleness: '-1': expected an integer >= 0"),
        (["--max-staleness", "one"], "--max-staleness: 'one': expected an integer >= 0"),
        (["--max-staleness", "1", "--partial-rollouts", "64"], "--partial-rollouts takes no value now ('64')"),
        (["--partial-rollouts"], "--partial-rollouts needs --max-staleness >= 1"),
        (["--max-staleness", "1", "--dispatch", "any"], "--dispatch: invalid choice: 'any'"),
        (["--oversample"], "--oversample needs --max-staleness >= 1"),
    ],
)
def test_bad_async_flags_give_one_line(args, message, capsys):
    from gcore.cli import main

    assert main(["simulate", "--devices", "8", "--steps", "1", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gcore: error: gcore simulate") and message in lines[0], lines


def test_async_needs_the_dynamic_placement():
    with pytest.raises(ConfigError, match="dynamic placement"):
        simulate_async(StaticPlacement(offload=True), 16, 2, _work())  # type: ignore[arg-type]


def test_async_timeline_by_hand():
    """4 devices: training is 8 of the first batch's 52 device-seconds, so 1 trains; of the other 3,
    2 generate and 1 judges (the split held). Each generation device decodes its 2 responses of 10
    tokens in 10 s (1 s a step), the judge gives the 4 verdicts in one 1 s step, training takes 2 s,
    loading weights 0.5 s. Batch 0: generated by 10, judged by 11, trained 11-13. Batch 1 (K=1 lets
    it start on version 0): 10-20, judged 21, trained 21-23. Batch 2 needs version 1 (there from
    13): loads it at 20 (0.5 s), 20.5-30.5, judged 31.5, trained 31.5-33.5. Steps: 13, 10, 10.5 s."""
    work = Workload(
        samples_per_device=1, prompt_tokens=0, median_tokens=10, sigma=0.0, max_tokens=100, length_drift=0.0,
        decode_step_s=1.0, generate_token_s=0.0, judge_token_s=0.0, judge_generate_token_s=0.0,
        judge_output_tokens=1, judge_decode_step_s=1.0, swap_s=0.5, train_token_s=0.0, train_step_s=2.0,
    )
    results = simulate_async(DynamicPlacement(hysteresis=1e9), 4, 3, work, max_staleness=1, dispatch="device")
    assert [(r.train_devices, r.generate_devices, r.judge_devices) for r in results] == [(1, 2, 1)] * 3
    assert [r.step_s for r in results] == [13.0, 10.0, 10.5]
    assert [r.staleness for r in results] == [{0: 4}, {1: 4}, {1: 4}]
    # step 1 (13-23): each generation device decodes 13-20 and 20.5-23 and loads weights 20-20.5
    assert results[1].busy["generate"] == pytest.approx(2 * 9.5) and results[1].idle["swap"] == pytest.approx(1.0)
    assert results[1].idle["generate"] == pytest.approx(0.0)
    assert results[1].idle["train"] == pytest.approx(10.0 - 2.0)


def test_oversample_sends_the_extra_samples_with_the_batch_and_trains_the_batch_size():
    """``--trainer.oversample`` in the model: batch ``b``'s first round is ``prompts_to_draw`` at the keep rate of the
    newest batch whose verdicts exist when it goes out (``b - K - 1`` under ``device`` dispatch), the second round only
    the shortfall at its own rate; the first batches, with no rate known, are drawn as without it."""
    work = _work(resample_drift=0.01)
    count = work.samples_per_device * 16
    plain, over = draw_batches(work, 16, 6, seed=3), draw_batches(work, 16, 6, seed=3, oversample_after=2)
    assert all(trained == count for _, trained in plain + over)
    plain, over = [rounds for rounds, _ in plain], [rounds for rounds, _ in over]
    assert over[:2] == plain[:2]
    for b in range(2, 6):
        first = prompts_to_draw(count, 1.0 - resample_share(work, b - 2))
        assert len(over[b][0]) == first > count
        shortfall = sum(len(r) for r in over[b][1:])
        assert shortfall == max(0, count - math.floor(first * (1.0 - resample_share(work, b)))) < len(plain[b][1])
    # every sample of one length: a step trains on the batch's tokens, not on the surplus nor the dropped samples
    even = _work(sigma=0.0, length_drift=0.0, train_token_s=1e-3)
    for oversample in (False, True):
        results = simulate_async(DynamicPlacement(), 16, 6, even, max_staleness=1, dispatch="device",
                                 oversample=oversample)
        tokens = count * (even.median_tokens + even.prompt_tokens)
        assert all(r.stages["train"] == pytest.approx(even.train_step_s + even.train_token_s * tokens / r.train_devices)
                   for r in results)


@pytest.mark.parametrize("dispatch", ["step", "device"])
def test_oversample_idles_less_when_the_second_round_waits_for_a_slow_judge(dispatch):
    """A judge that writes a long rationale: without ``oversample`` each generation device waits for its first
    round's verdicts before its second round; with it, the extra samples went out with the batch."""
    work = _work(judge_output_tokens=256, judge_decode_step_s=0.02)
    runs = run_all(16, 8, work, {}, release_tail=False, max_staleness=1, dispatch=dispatch, oversample=True)
    idle = {name: summarize(results, 16)["idle_device_hours"] for name, results in runs.items()}
    assert idle["dynamic K=1 oversample"] < 0.9 * idle["dynamic K=1"], idle


def test_binomial_draws_keep_each_group_with_the_keep_rate_and_follow_the_trainers_rounds():
    """``resample_draw: binomial``: each group of ``group_size`` samples is kept with probability 1 - share; a step
    draws more rounds as the trainer's ``filter`` does (the shortfall over the keep rate seen, at most
    ``max_rounds``), and trains on at most the batch. The lengths come from the same stream as ``share``'s."""
    work = _work(resample_fraction=0.3, resample_draw="binomial", group_size=4, max_rounds=3)
    target, count = 16 * work.samples_per_device // 4, 16 * work.samples_per_device
    rng = random.Random(0)
    drawn = kept = 0
    for _ in range(200):
        sizes, k = keep_rounds(work, 0, target, target, rng)
        assert sizes[0] == target and 1 <= len(sizes) <= 3
        assert len(sizes) == 1 or all(s <= 4 * target for s in sizes[1:])
        assert len(sizes) == 3 or k >= target  # only the last round may leave the step short
        drawn, kept = drawn + sum(sizes), kept + k
    assert kept / drawn == pytest.approx(0.7, abs=0.01)
    batches = draw_batches(work, 16, 20, seed=1)
    assert all(sum(len(r) for r in rounds) % 4 == 0 and trained <= count for rounds, trained in batches)
    assert sum(len(rounds) > 1 for rounds, _ in batches) >= 18  # a second round almost every step
    assert [r[0][0] for r, _ in batches][:1] == [r[0][0] for r, _ in draw_batches(_work(), 16, 1, seed=1)]
    with pytest.raises(ConfigError, match="resample_draw 'fixed': valid choices: share, binomial"):
        _work(resample_draw="fixed")


def test_binomial_oversample_sizes_the_first_round_at_the_keep_rate_seen_and_mostly_needs_no_second():
    """With ``binomial`` draws, ``--trainer.oversample``'s margin is what it is for: batch ``b``'s first round is
    ``prompts_to_draw`` at the keep rate batch ``b - oversample_after`` saw, and at confidence 0.9 most batches fill
    their share in one round (with ``share`` draws the margin is never needed but for the drift)."""
    work = _work(resample_fraction=0.3, resample_draw="binomial", group_size=4)
    target = 16 * work.samples_per_device // 4
    batches = draw_batches(work, 16, 40, seed=2, oversample_after=2)
    rng = keep_seed(2)
    seen = []
    for b, (rounds, _) in enumerate(batches):
        first = prompts_to_draw(target, seen[b - 2]) if b >= 2 else target
        sizes, kept = keep_rounds(work, b, first, target, rng)
        assert [len(r) for r in rounds] == [size * 4 for size in sizes]
        seen.append(kept / sum(sizes))
    assert sum(len(rounds) > 1 for rounds, _ in batches[2:]) <= 10  # about one in ten: 3.8 expected
    assert all(len(rounds) > 1 for rounds, _ in batches[:2])  # no keep rate known yet: the plain rounds
