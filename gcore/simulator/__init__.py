"""``gcore simulate``: training steps on a simulated cluster under the trainer's placement policies.

``model``: the synchronous loop (``simulate``: static and dynamic placement, step by step) and the
device model it is built on; ``asynchronous``: bounded staleness and partial rollouts
(``simulate_async``); ``calibration``: the per-token costs fitted to real runs; ``cli``: the command.
docs/simulator.md describes what is modelled.
"""

from gcore.simulator.asynchronous import simulate_async
from gcore.simulator.model import StepResult, Workload, compare, load_workload, simulate, summarize

__all__ = ["StepResult", "Workload", "compare", "load_workload", "simulate", "simulate_async", "summarize"]
