"""``dynamic`` placement: generation and a generative judge on two partitions sized from utilization."""

from __future__ import annotations

import math

from gcore.errors import ConfigError
from gcore.placement.base import PlacementPolicy, Telemetry

GENERATE, JUDGE = "generate", "reward"


class DynamicPlacement(PlacementPolicy):
    """Splits ``devices`` into a policy-generation partition and a judge partition that run at once.

    After each step ``update`` reads the busy seconds per role (the slowest rank's, from telemetry
    gathered on every rank, so every rank decides the same) and moves devices towards the split with
    the shortest predicted rollout: without a reported generation floor, the split that balances the
    measured work; with one (a long tail that more devices cannot shorten), more judge devices.

    Args:
        devices: devices to split (0: the world size). On CPU a device is an engine worker process.
        judge_fraction: the judge partition's share at the start.
        min_fraction: smallest share of devices either partition may get (at least one device).
        hysteresis: move only when the two roles' idle times differ by more than this share of the
            rollout phase.
        max_move_fraction: move at most this share of the devices in one step (at least one).
    """

    def __init__(
        self,
        devices: int = 0,
        judge_fraction: float = 0.25,
        min_fraction: float = 0.125,
        hysteresis: float = 0.1,
        max_move_fraction: float = 0.125,
    ) -> None:
        for name, value in (("judge_fraction", judge_fraction), ("min_fraction", min_fraction)):
            if not 0 < value < 1:
                raise ConfigError(f"--placement.{name} must be in (0, 1), got {value}")
        if hysteresis < 0 or not 0 < max_move_fraction <= 1:
            raise ConfigError("--placement.hysteresis must be >= 0 and max_move_fraction in (0, 1]")
        self.devices, self.judge_fraction, self.min_fraction = devices, judge_fraction, min_fraction
        self.hysteresis, self.max_move_fraction = hysteresis, max_move_fraction
        self.total = 0
        self.judge_devices = 0

    @property
    def generate_devices(self) -> int:
        return self.total - self.judge_devices

    @property
    def min_devices(self) -> int:
        return max(1, math.ceil(self.min_fraction * self.total))

    def setup(self, world_size: int, device_type: str) -> None:
        if device_type != "simulated":
            raise ConfigError(
                "--placement dynamic runs in `gcore simulate` only so far: the trainer does not yet run "
                "generation and judge on separate worker partitions; use --placement static"
            )
        self.total = self.devices or world_size
        if self.total < 2:
            raise ConfigError(
                f"--placement dynamic needs at least 2 devices (one for generation, one for the judge), "
                f"got {self.total}; use --placement static or give --placement.devices"
            )
        if 2 * self.min_devices > self.total:
            raise ConfigError(
                f"--placement.min_fraction {self.min_fraction} leaves no room to split {self.total} devices"
            )
        wanted = round(self.judge_fraction * self.total)
        self.judge_devices = min(max(wanted, self.min_devices), self.total - self.min_devices)

    def state_dict(self) -> dict:
        return {"total": self.total, "judge_devices": self.judge_devices}

    def load_state_dict(self, state: dict) -> None:
        """The saved split; on a different device count, the same judge share, within the bounds."""
        share = state["judge_devices"] / state["total"] if state.get("total") else self.judge_fraction
        wanted = state["judge_devices"] if state.get("total") == self.total else round(share * self.total)
        self.judge_devices = min(max(wanted, self.min_devices), self.total - self.min_devices)

    def predicted_rollout(self, judge_devices: int, busy: tuple[float, float], floors: tuple[float, float]) -> float:
        """Rollout seconds predicted for a judge partition of ``judge_devices`` from this step's measurements.

        Generation takes its latency floor (the longest response decoded alone, which more devices
        cannot shorten) plus a throughput part that scales with 1/devices; the judge's work scales
        with 1/devices, and its last verdict comes at least ``judge floor`` after the last sample.
        """
        generate_busy, judge_busy = busy
        generate_floor, judge_floor = floors
        floor = min(generate_floor, generate_busy)
        generate = floor + (generate_busy - floor) * self.generate_devices / (self.total - judge_devices)
        judge = judge_busy * self.judge_devices / judge_devices
        return max(generate + judge_floor, judge)

    def target_judge_devices(
        self, generate_busy: float, judge_busy: float, generate_floor: float = 0.0, judge_floor: float = 0.0
    ) -> int:
        """The judge partition (within the bounds) with the shortest predicted rollout.

        Without floors this is the split that balances the measured work (device-seconds) of both
        roles; with a generation floor (a long tail) the judge gets more, since extra generation
        devices do not shorten the tail.
        """
        if generate_busy + judge_busy <= 0:
            return self.judge_devices
        low, high = self.min_devices, self.total - self.min_devices
        busy, floors = (generate_busy, judge_busy), (generate_floor, judge_floor)
        return min(
            range(low, high + 1),
            key=lambda j: (round(self.predicted_rollout(j, busy, floors), 9), abs(j - self.judge_devices)),
        )

    def update(self, telemetry: Telemetry) -> dict[str, float]:
        """Moves devices between the partitions from this step's per-role busy seconds.

        Reads ``generate`` and ``reward`` busy seconds, and optionally ``rollout`` (the phase's wall
        time), ``generate_floor`` (the longest response's decode time at batch 1) and
        ``reward_floor`` (one verdict's latency); the slowest rank's value of each.
        """
        if self.total == 0:
            raise RuntimeError("DynamicPlacement.update called before setup")
        generate_busy, judge_busy = telemetry.busiest(GENERATE), telemetry.busiest(JUDGE)
        floors = (telemetry.busiest("generate_floor"), telemetry.busiest("reward_floor"))
        rollout = max(telemetry.busiest("rollout"), generate_busy, judge_busy)
        idle_generate, idle_judge = rollout - generate_busy, rollout - judge_busy
        moved = 0
        if rollout > 0 and abs(idle_generate - idle_judge) > self.hysteresis * rollout:
            target = self.target_judge_devices(generate_busy, judge_busy, *floors)
            limit = max(1, int(self.max_move_fraction * self.total))
            moved = max(-limit, min(limit, target - self.judge_devices))
            busy = (generate_busy, judge_busy)
            now = self.predicted_rollout(self.judge_devices, busy, floors)
            # move only when the prediction improves: noise in the measurements never undoes a split
            if moved and self.predicted_rollout(self.judge_devices + moved, busy, floors) >= now:
                moved = 0
            self.judge_devices += moved
        return {
            "placement/judge_devices": float(self.judge_devices),
            "placement/generate_devices": float(self.generate_devices),
            "placement/moved": float(moved),
            "placement/idle_generate_s": idle_generate,
            "placement/idle_judge_s": idle_judge,
        }
