"""``gcore simulate``: static vs dynamic placement (and asynchronous training) on a simulated cluster."""

from __future__ import annotations

import argparse
import dataclasses
from typing import NoReturn

from gcore.errors import ConfigError
from gcore.placement import DynamicPlacement
from gcore.simulator.asynchronous import DISPATCH, simulate_async
from gcore.simulator.model import RESAMPLE_DRAWS, StepResult, Workload, compare, load_workload, plot, summarize


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every gcore command's bad input
        raise ConfigError(f"gcore simulate: {message} (see gcore simulate --help)")


def _staleness(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0 (0: synchronous)")
    return int(text)


def run_all(
    devices: int,
    steps: int,
    work: Workload,
    dynamic_options: dict,
    seed: int = 0,
    release_tail: bool = True,
    max_staleness: int = 0,
    partial: bool = False,
    dispatch: str = "device",
    oversample: bool = False,
) -> dict[str, list[StepResult]]:
    """``model.compare``'s runs, plus ``dynamic K=..`` (and ``.. partial``) when ``max_staleness`` >= 1.

    ``partial``: also the row with partial rollouts (a weight update cuts the responses in flight, as in
    the trainer); ``dispatch``: when a batch's requests go out (``asynchronous.simulate_async``); ``oversample``:
    also the row(s) with ``--trainer.oversample`` (dynamic sampling's extra prompts drawn up front).
    """
    runs = compare(devices, steps, work, dynamic_options, seed, release_tail)
    if max_staleness:
        name = f"dynamic K={max_staleness}"
        for cut, extra in ((False, False), (True, False), (False, True), (True, True)):
            if (cut and not partial) or (extra and not oversample):
                continue
            row = name + " partial" * cut + " oversample" * extra
            runs[row] = simulate_async(DynamicPlacement(**dynamic_options), devices, steps, work, seed, max_staleness,
                                       cut, dispatch, oversample=extra)
    return runs


def main(argv: list[str]) -> int:
    """``gcore simulate``: the policies on a workload YAML, printed and plotted."""
    parser = _Parser(prog="gcore simulate", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--config", help="YAML with a 'workload:' section (and optional 'dynamic:' options)")
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 512], help="cluster sizes (8..1024)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-release", action="store_true", help="leave out dynamic+release (tail devices swap to the judge)"
    )
    parser.add_argument(
        "--max-staleness", type=_staleness, default=0, metavar="K",
        help="also run dynamic placement trained asynchronously: generation runs ahead of training, "
             "samples at most K policy versions old (0: only the synchronous loop)",
    )
    parser.add_argument(
        "--partial-rollouts", action="store_true",
        help="with --max-staleness: also run it with partial rollouts, as the trainer does them: when a "
             "training step ends, its new weights cut every response in flight, which continues with them",
    )
    parser.add_argument(
        "--dispatch", choices=DISPATCH, default="device",
        help="when a batch's generation starts with --max-staleness, as --trainer.dispatch: 'device' (the "
             "trainer's default: each device starts it once it has finished its share of the batches before and "
             "the weights it may use exist) or 'step' (its requests go out when the step K before it starts "
             "training, after the batch before came in from every device)",
    )
    parser.add_argument(
        "--oversample", action="store_true",
        help="with --max-staleness: also run it with --trainer.oversample: dynamic sampling's extra prompts go out "
             "with the batch, as many as the newest keep rate says it needs, instead of in a second round that "
             "waits for the first round's verdicts",
    )
    parser.add_argument(
        "--resample-draw", choices=RESAMPLE_DRAWS, default=None,
        help="how dynamic sampling's dropped samples are drawn, over the workload's resample_draw: 'share' (exactly "
             "resample_fraction of the first round, drawn again once) or 'binomial' (each group kept with probability "
             "1 - resample_fraction, further rounds as the trainer's filter draws them)",
    )
    parser.add_argument("--plot", default="simulate.png",
                        help="PNG path; {devices} is replaced per size; empty (--plot '') for no plot")
    for flag, value in zip(argv, [*argv[1:], ""], strict=True):  # the removed token budget: --partial-rollouts 400
        budget = flag.split("=", 1)[1] if flag.startswith("--partial-rollouts=") else value
        if flag.startswith("--partial-rollouts") and budget.isdigit():
            parser.error(f"--partial-rollouts takes no value now ({budget!r}): responses are cut when new weights "
                         "arrive, as in the trainer; the token budget model was removed")
    args = parser.parse_args(argv)
    if args.partial_rollouts and not args.max_staleness:
        parser.error("--partial-rollouts needs --max-staleness >= 1 (a cut response continues with newer weights)")
    if args.oversample and not args.max_staleness:
        parser.error("--oversample needs --max-staleness >= 1 (it is simulated for the asynchronous rows)")
    work, dynamic_options = load_workload(args.config)
    if args.resample_draw is not None:
        work = dataclasses.replace(work, resample_draw=args.resample_draw)
    for devices in args.devices:
        if not 2 <= devices <= 4096:
            raise ConfigError(f"--devices {devices}: expected 2..4096")
        if args.max_staleness and devices < 4:
            raise ConfigError(f"--devices {devices}: --max-staleness needs at least 4 (train, generate, judge)")
        runs = run_all(devices, args.steps, work, dynamic_options, args.seed, not args.no_release,
                       args.max_staleness, partial=args.partial_rollouts, dispatch=args.dispatch,
                       oversample=args.oversample)
        base = summarize(runs["static"], devices)
        print(f"{devices} devices, {args.steps} steps")
        print(f"  {'policy':<24} {'step_s':>8} {'idle':>6} {'idle_gen':>8} {'idle_judge':>10} {'idle_train':>10} "
              f"{'idle_swap':>9} {'dev_h':>9} {'idle_dev_h':>10}")
        for name, results in runs.items():
            s = summarize(results, devices)
            print(
                f"  {name:<24} {s['step_s']:8.1f} {s['idle']:6.3f} {s['idle_generate']:8.3f} {s['idle_judge']:10.3f} "
                f"{s['idle_train']:10.3f} {s['idle_swap']:9.3f} {s['device_hours']:9.1f} {s['idle_device_hours']:10.1f}"
            )
        for name in list(runs)[1:]:
            dyn, last = summarize(runs[name], devices), runs[name][-1]
            split = f"{last.generate_devices} generate / {last.judge_devices} judge"
            if last.train_devices:
                stale = max(k for r in runs[name] for k in r.staleness)
                split += f" / {last.train_devices} train, samples at most {stale} version(s) old"
            print(
                f"  {name}/static: step time x{dyn['step_s'] / base['step_s']:.3f}, "
                f"idle device-hours x{dyn['idle_device_hours'] / base['idle_device_hours']:.3f}, "
                f"device-hours x{dyn['device_hours'] / base['device_hours']:.3f}, final split {split}"
            )
        if not args.plot:
            continue
        path = args.plot.replace("{devices}", str(devices)) if "{devices}" in args.plot else (
            args.plot if len(args.devices) == 1 else args.plot.replace(".png", f"_{devices}.png")
        )
        try:
            plot(runs, devices, path)
            print(f"  plot: {path}")
        except ImportError:
            print("  (no plot: pip install matplotlib)")
    return 0
