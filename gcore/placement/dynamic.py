"""``dynamic`` placement: generation and a generative judge on two partitions sized from utilization."""

from __future__ import annotations

import math

from gcore.errors import ConfigError
from gcore.placement.base import PlacementPolicy, Telemetry

GENERATE, JUDGE = "generate", "reward"


class DynamicPlacement(PlacementPolicy):
    """Splits ``devices`` into a policy-generation partition and a judge partition that run at once.

    After each step ``update`` reads the busy seconds per role (the slowest rank's, from telemetry
    gathered on every rank, so every rank decides the same) and moves devices from the role that
    idled more to the one that idled less, towards the split that balances the measured work.

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

    def target_judge_devices(self, generate_busy: float, judge_busy: float) -> int:
        """The judge partition that balances the measured work (device-seconds) of both roles."""
        work_generate = generate_busy * self.generate_devices
        work_judge = judge_busy * self.judge_devices
        if work_generate + work_judge <= 0:
            return self.judge_devices
        return round(self.total * work_judge / (work_generate + work_judge))

    def update(self, telemetry: Telemetry) -> dict[str, float]:
        """Moves devices between the partitions from this step's per-role busy seconds."""
        if self.total == 0:
            raise RuntimeError("DynamicPlacement.update called before setup")
        generate_busy, judge_busy = telemetry.busiest(GENERATE), telemetry.busiest(JUDGE)
        rollout = max(telemetry.busiest("rollout"), generate_busy, judge_busy)
        idle_generate, idle_judge = rollout - generate_busy, rollout - judge_busy
        moved = 0
        if rollout > 0 and abs(idle_generate - idle_judge) > self.hysteresis * rollout:
            target = self.target_judge_devices(generate_busy, judge_busy)
            target = min(max(target, self.min_devices), self.total - self.min_devices)
            limit = max(1, int(self.max_move_fraction * self.total))
            moved = max(-limit, min(limit, target - self.judge_devices))
            # only towards the busier role: never let the target undo the idle-time signal
            if (moved > 0 and idle_judge > idle_generate) or (moved < 0 and idle_generate > idle_judge):
                moved = 0
            self.judge_devices += moved
        return {
            "placement/judge_devices": float(self.judge_devices),
            "placement/generate_devices": float(self.generate_devices),
            "placement/moved": float(moved),
            "placement/idle_generate_s": idle_generate,
            "placement/idle_judge_s": idle_judge,
        }
