"""``PlacementPolicy.start_rollout`` and ``resume_rollout`` return one typed object, an ``InFlight``, which the
controller reads directly (what a checkpoint records of a rollout in flight)."""

from __future__ import annotations

import pytest

from gcore.errors import ConfigError
from gcore.placement.base import InFlight
from gcore.placement.static import StaticPlacement
from gcore.rollout import RolloutJob


class PlainFunction(StaticPlacement):
    """A policy of one's own written against the old contract: its rollout in flight is a plain function."""

    def start_rollout(self, job: RolloutJob):
        return lambda: []


class Wrapped(StaticPlacement):
    def start_rollout(self, job: RolloutJob):
        return InFlight(lambda: [], generations=lambda: [])


def test_the_built_in_rollouts_in_flight_are_in_flight_objects():
    """In the controller's process: started ahead, a rollout runs when collected (``deferred``); resumed from its
    recorded generations, it is neither deferred nor recordable again. Nothing runs until it is called."""
    job = None  # never reached: nothing is collected here
    started, resumed = StaticPlacement().start_rollout(job), StaticPlacement().resume_rollout(job, [])
    assert isinstance(started, InFlight) and started.deferred and started.generations is None
    assert isinstance(resumed, InFlight) and not resumed.deferred and resumed.generations is None


def test_a_policy_whose_rollout_in_flight_is_not_an_in_flight_is_refused_in_one_line():
    """Refused when it starts the rollout, naming the policy and the method, not at the first checkpoint; a policy
    of one's own that returns an ``InFlight`` passes through unchanged."""
    with pytest.raises(ConfigError) as err:
        PlainFunction().start_rollout(None)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("placement PlainFunction.start_rollout returned a function, not an InFlight")
    in_flight = Wrapped().start_rollout(None)
    assert in_flight() == [] and in_flight.generations is not None and in_flight.generations() == []
