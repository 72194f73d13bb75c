"""The ``PlacementPolicy`` contract: where each role runs, and when it holds device memory."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from gcore.engines.base import Engine


@dataclass
class Telemetry:
    """Per-stage busy seconds of one step, gathered from every controller (rank -> stage -> s)."""

    step: int
    stage_seconds: list[dict[str, float]] = field(default_factory=list)

    def busiest(self, stage: str) -> float:
        return max((s.get(stage, 0.0) for s in self.stage_seconds), default=0.0)


class PlacementPolicy(ABC):
    """Decides how roles (policy generation, judge, training) share the devices.

    ``before_generate``/``after_generate`` run around the generation stage of every step on every
    controller; ``update`` gets the step's gathered telemetry and returns what to log. Decisions
    must be computed identically on every rank from the same telemetry: there is no master.
    """

    @abstractmethod
    def setup(self, world_size: int, device_type: str) -> None:
        """Check that the roles fit the devices; raise a ``GcoreError`` before any work if not."""

    def before_generate(self, engine: Engine) -> None:
        """Called right before generation."""

    def after_generate(self, engine: Engine) -> None:
        """Called right after generation (and reward)."""

    def before_sync(self, engine: Engine) -> None:
        """Called right before the trainer's new weights are sent to the engine."""

    def update(self, telemetry: Telemetry) -> dict[str, float]:
        """Re-decide placement from measured utilization; returns metrics to log."""
        return {}

    def state_dict(self) -> dict:
        """The current placement decision, saved in every checkpoint as JSON (after ``setup``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned, when a run resumes (after ``setup``, which may have
        seen a different number of devices)."""
