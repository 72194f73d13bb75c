"""Thread defaults for the processes gcore runs on one machine: how many torch threads, and how OpenMP waits.

torch runs its CPU kernels on an OpenMP thread team. Two settings decide how that team behaves next to other
work on the machine:

- how many threads: gcore gives each process it runs an equal share of the cores this process may use
  (``os.sched_getaffinity``: a ``taskset`` or a container's CPU set counts, the machine's other cores do not),
  at least one: ``default_threads(cores, processes)``;
- how a thread waits for the next parallel region: by default libgomp (torch's OpenMP on Linux) spins on a
  core for a while (``GOMP_SPINCOUNT``, 300000 turns) before it sleeps. A decoder runs thousands of small
  kernels per step, each one a parallel region; when another process holds one of the cores, the thread that
  spins keeps the core from the thread that has the work, and every region waits for the OS to switch them.
  gcore therefore sets ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep at once) in the processes it starts.

A setting the user made wins: ``OMP_NUM_THREADS`` (then gcore sets no thread count), ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` (then gcore sets no wait policy), and an explicit ``--placement.threads``. OpenMP reads its
variables once, when torch is first imported in a process, so the wait policy reaches the processes gcore
starts (engine workers, the controllers of ``--trainer.devices N``) and the process that runs ``gcore fit``
(the command line sets it before it imports torch); a Python program that imports torch before it calls
``Trainer.fit`` keeps libgomp's default wait in that process. See docs/threads.md for the measurements.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping

log = logging.getLogger(__name__)

#: the wait policy gcore sets where the user set none
WAIT_POLICY = "PASSIVE"
#: variables by which a user chooses how OpenMP threads wait: any one of them set, gcore sets none
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under ``taskset`` or a container)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads(cores: int, processes: int) -> int:
    """Each of ``processes`` processes' share of ``cores`` cores: ``cores // processes``, at least 1."""
    if cores < 1 or processes < 1:
        raise ValueError(f"cores and processes must be >= 1, got {cores} and {processes}")
    return max(1, cores // processes)


def user_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """The thread count the user chose with ``OMP_NUM_THREADS`` (its first value), or ``None``."""
    value = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def thread_env(threads: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables to give a process gcore starts, before it imports torch: ``OMP_NUM_THREADS`` (``threads``)
    and ``OMP_WAIT_POLICY``, each only where the user set none of its own in ``environ``."""
    env = {}
    if user_threads(environ) is None:
        env["OMP_NUM_THREADS"] = str(threads)
    if not any(name in environ for name in WAIT_VARIABLES):
        env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return env


def set_wait_policy(environ: MutableMapping[str, str] = os.environ, torch_imported: bool | None = None) -> str:
    """Make OpenMP threads sleep instead of spin in this process and the processes it starts, unless the user chose
    how they wait; gcore's ``__init__`` calls it before it imports torch. Returns who decides this process's wait:
    ``"gcore"`` (set here), ``"user"`` (a variable of ``WAIT_VARIABLES`` was set), or ``"libgomp"`` (torch was
    imported first, so OpenMP already read its variables: nothing is set)."""
    global wait_policy_by
    if torch_imported is None:
        torch_imported = "torch" in sys.modules
    if any(name in environ for name in WAIT_VARIABLES):
        wait_policy_by = "user"
    elif torch_imported:
        wait_policy_by = "libgomp"
    else:
        environ["OMP_WAIT_POLICY"] = WAIT_POLICY
        wait_policy_by = "gcore"
    return wait_policy_by


#: who decided how this process's OpenMP threads wait: ``set_wait_policy``'s answer when gcore was imported
wait_policy_by = "libgomp"
_warned = False


def warn_if_spinning() -> None:
    """Once per process, when torch was imported before gcore and the user set no wait policy: say that this
    process's OpenMP threads spin-wait, and how to make them sleep."""
    global _warned
    if wait_policy_by == "libgomp" and not _warned:
        _warned = True
        log.warning("torch was imported before gcore, so this process's OpenMP threads spin while they wait (libgomp's "
                    "default); next to other work on the machine that can make steps many times slower. "
                    "Import gcore first or set OMP_WAIT_POLICY=PASSIVE (docs/threads.md)")


def configure(processes: int = 1) -> int:
    """Set this process's torch threads to its share of the usable cores (``processes`` processes share them),
    unless the user set ``OMP_NUM_THREADS``; returns the thread count in effect."""
    import torch

    if user_threads() is None:
        torch.set_num_threads(default_threads(usable_cores(), processes))
    return torch.get_num_threads()


def worker_threads(workers: int) -> int:
    """torch threads of each of ``workers`` engine worker processes that one controller starts: the user's
    ``OMP_NUM_THREADS``, else an equal share of the controller's own threads (its share of the usable cores: the
    controllers of one machine divide them, ``--trainer.devices``). The workers generate while the controller waits,
    and the controller trains while they wait, so the two shares overlap in time, not in cores."""
    import torch

    return user_threads() or default_threads(torch.get_num_threads(), workers)


@contextlib.contextmanager
def spawning(threads: int) -> Iterator[None]:
    """Processes started inside (``multiprocessing`` spawn, ``subprocess``) get ``thread_env(threads)`` in their
    environment; this process's environment is restored afterwards."""
    added = thread_env(threads)
    saved = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


set_wait_policy()  # on import: gcore's ``__init__`` imports this module before anything imports torch
