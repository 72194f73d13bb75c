"""``dynamic`` placement: generation and a generative judge on two partitions sized from utilization."""

from __future__ import annotations

from gcore.errors import ConfigError
from gcore.placement.base import PlacementPolicy


class DynamicPlacement(PlacementPolicy):
    """Splits devices between policy generation and a generative reward model (not built yet).

    Args:
        min_fraction: smallest share of devices either partition may get.
        hysteresis: relative idle-time difference needed before a device moves.
    """

    def __init__(self, min_fraction: float = 0.125, hysteresis: float = 0.1) -> None:
        self.min_fraction = min_fraction
        self.hysteresis = hysteresis

    def setup(self, world_size: int, device_type: str) -> None:
        raise ConfigError(
            "--placement dynamic is not implemented yet (it needs a generative reward model to place "
            "beside the policy; tracked in the placement issue); use --placement static"
        )
