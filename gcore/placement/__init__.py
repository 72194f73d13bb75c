"""Placement policies: ``PlacementPolicy``, ``static`` and ``dynamic``."""

from gcore.placement.base import PlacementPolicy, Telemetry
from gcore.placement.dynamic import DynamicPlacement
from gcore.placement.static import StaticPlacement

__all__ = ["DynamicPlacement", "PlacementPolicy", "StaticPlacement", "Telemetry"]
