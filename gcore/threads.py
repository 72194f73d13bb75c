"""Thread defaults for the processes gcore runs on one machine: how many torch threads, and how OpenMP waits.

torch runs its CPU kernels on an OpenMP thread team. A decoder runs thousands of small kernels per step, each one
a parallel region that ends in a barrier, so two settings decide how fast a step is next to other work:

- how many threads: each process gcore runs gets an equal share of the cores this process may use
  (``os.sched_getaffinity``: a ``taskset`` or a container's CPU set counts), at least one:
  ``default_threads(cores, processes)``. A controller's count then adapts (``ThreadGovernor``): before each stage
  it reads how much of those cores other processes used since it last looked (``/proc/stat`` less this process
  tree's own time) and runs with the cores they left free, at least one. One thread has no barrier to wait at;
- how a thread waits at the barrier: libgomp (torch's OpenMP on Linux) spins on its core for a while
  (``GOMP_SPINCOUNT``, 300000 turns) before it sleeps. When another process holds one of the cores, the spinning
  thread keeps it from the thread that has the work, and every region waits for the OS to switch them (a step of
  0.2 s took 20 s next to a busy loop). Where the count adapts, gcore sets ``GOMP_SPINCOUNT=30000``: as fast as
  libgomp's spin on free cores, and a neighbour costs at most the stages before the governor drops a thread.
  Where the count is fixed (engine workers, ``OMP_NUM_THREADS``) it sets ``OMP_WAIT_POLICY=PASSIVE``: threads
  sleep at once.

A setting the user made wins: ``OMP_NUM_THREADS`` when gcore is imported (a fixed count, no adaptation; not the one
Lightning Fabric gives the controllers it launches: ``launching``),
``torch.set_num_threads(T)`` before ``Trainer.fit`` (the most the governor uses), ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` (gcore sets no wait), and an explicit ``--placement.threads``. OpenMP reads its variables once,
when torch is first imported in a process, so gcore's wait reaches the processes it starts and the process that
imports gcore before torch; a Python program that imports torch first keeps libgomp's default wait in that process
(the governor still adapts its count). See docs/threads.md for the measurements.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping, MutableMapping
from dataclasses import dataclass

from gcore.environ import environ_set, quiet_torch_cpp_warnings

log = logging.getLogger(__name__)

#: the wait policy gcore sets where the user set none and the thread count is fixed (engine workers, OMP_NUM_THREADS)
WAIT_POLICY = "PASSIVE"
#: the turns a thread spins before it sleeps, where gcore adapts the thread count (libgomp's default: 300000)
SPIN_COUNT = "30000"
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


#: set by ``Trainer.fit`` for the controllers Lightning Fabric launches: the user's ``OMP_NUM_THREADS`` as the launching
#: process saw it when gcore was imported (``""``: none). Fabric gives each controller it launches
#: ``OMP_NUM_THREADS`` = its share of the cores; that share is gcore's to adapt, not the user's fixed choice.
USER_THREADS_VARIABLE = "GCORE_USER_OMP_NUM_THREADS"


def user_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """The thread count the user chose with ``OMP_NUM_THREADS`` (its first value), or ``None``; in a controller that
    Fabric launched, the launching process's (``USER_THREADS_VARIABLE``)."""
    value = environ.get(USER_THREADS_VARIABLE, environ.get("OMP_NUM_THREADS", "")).split(",")[0].strip()
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
    """Choose how this process's OpenMP threads wait, unless the user chose; gcore's ``__init__`` calls it before it
    imports torch. With an adaptive thread count (no ``OMP_NUM_THREADS``) threads spin ``SPIN_COUNT`` turns before
    they sleep (``GOMP_SPINCOUNT``): fast on free cores, and the governor drops to one thread (no barrier to spin
    in) when others take a core. With a fixed count they sleep at once (``OMP_WAIT_POLICY=PASSIVE``): nothing would
    take a thread away next to other work. Returns who decides this process's wait: ``"gcore"`` (set here),
    ``"user"`` (a variable of ``WAIT_VARIABLES`` was set), or ``"libgomp"`` (torch was imported first, so OpenMP
    already read its variables: nothing is set)."""
    global wait_policy_by, wait
    if torch_imported is None:
        torch_imported = "torch" in sys.modules
    if any(name in environ for name in WAIT_VARIABLES):
        wait_policy_by = "user"
    elif torch_imported:
        wait_policy_by = "libgomp"
    else:
        name, value = ("GOMP_SPINCOUNT", SPIN_COUNT) if user_threads(environ) is None else ("OMP_WAIT_POLICY",
                                                                                             WAIT_POLICY)
        environ[name] = value
        wait, wait_policy_by = f"{name}={value}", "gcore"
    return wait_policy_by


def forget_spin_count(environ: MutableMapping[str, str] = os.environ) -> None:
    """Once torch is imported (libgomp has read it): take gcore's own ``GOMP_SPINCOUNT`` out of the environment, so
    that the processes this one starts choose their wait themselves (engine workers, with their fixed count, get the
    passive wait: ``thread_env``) and do not take it for the user's."""
    if wait == f"GOMP_SPINCOUNT={SPIN_COUNT}" and environ.get("GOMP_SPINCOUNT") == SPIN_COUNT:
        del environ["GOMP_SPINCOUNT"]


#: who decided how this process's OpenMP threads wait: ``set_wait_policy``'s answer when gcore was imported
wait_policy_by = "libgomp"
#: the wait gcore set in this process (``NAME=value``), or ``""``
wait = ""
_warned = False


def warn_if_spinning() -> None:
    """Once per process, when torch was imported before gcore and the user set no wait policy: say that this
    process's OpenMP threads spin-wait, and how to make them sleep."""
    global _warned
    if wait_policy_by == "libgomp" and not _warned:
        _warned = True
        log.warning("torch was imported before gcore, so this process's OpenMP threads spin 300000 turns while they "
                    "wait (libgomp's default); next to other work on the machine a stage can be many times slower "
                    "until gcore drops a thread. Import gcore first or set GOMP_SPINCOUNT=30000 (docs/threads.md)")


def worker_threads(workers: int) -> int:
    """torch threads of each of ``workers`` engine worker processes that one controller starts: the user's
    ``OMP_NUM_THREADS``, else an equal share of the controller's own threads (its share of the usable cores: the
    controllers of one machine divide them, ``--trainer.devices``). The workers generate while the controller waits,
    and the controller trains while they wait, so the two shares overlap in time, not in cores."""
    import torch

    return user_threads() or default_threads(torch.get_num_threads(), workers)


def spawning(threads: int) -> contextlib.AbstractContextManager[None]:
    """Processes started inside (``multiprocessing`` spawn, ``subprocess``) get ``thread_env(threads)`` in their
    environment; this process's environment is restored afterwards."""
    return environ_set(thread_env(threads))


# ---------------------------------------------------------------------------------------------------------------
# The adaptive thread count: fewer threads while other processes take cores
# ---------------------------------------------------------------------------------------------------------------

#: another process's use of a core, in cores, from which gcore counts that core as taken
TAKEN_FROM = 0.25
#: the shortest interval over which the governor reads the machine (shorter ones are too coarse in clock ticks)
MIN_INTERVAL_S = 0.2


@dataclass(frozen=True)
class CpuReading:
    """CPU seconds since boot of the cores this process may use: ``busy`` (every process), ``total`` (busy and idle)
    and ``own`` (this process and its descendants, every thread)."""

    busy: float
    total: float
    own: float


def _process_ticks(pid: int | str) -> int:
    """utime + stime of one process (all its threads), in clock ticks; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from the state (field 3)


def _descendants(pid: int | str) -> list[str]:
    children: list[str] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += f.read().split()
    except OSError:
        return []
    return children + [d for child in children for d in _descendants(child)]


def read_cpu(cores: Collection[int] | None = None) -> CpuReading:
    """The machine's and this process tree's CPU time so far (Linux ``/proc``), over ``cores`` (default: the cores
    this process may use)."""
    cores = set(os.sched_getaffinity(0) if cores is None else cores)
    tick = os.sysconf("SC_CLK_TCK")
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    own = _process_ticks("self") + sum(_process_ticks(pid) for pid in _descendants("self"))
    return CpuReading(busy / tick, total / tick, own / tick)


def free_threads(others: float, cores: int, ceiling: int) -> int:
    """The torch threads to run with when other processes used ``others`` cores (on average) of the ``cores`` this
    process may use: one thread fewer per core they took (``TAKEN_FROM`` of it counts), at most ``ceiling``, at
    least 1."""
    taken = math.floor(others + 1 - TAKEN_FROM) if others > 0 else 0
    return max(1, min(ceiling, cores - taken))


class ThreadGovernor:
    """Sets this process's torch threads, each time it is asked (``update``: before each stage), to the cores that
    other processes left free since it last looked, up to ``ceiling`` (the process's share of the cores).

    With other work on a core, a second OpenMP thread mostly waits for that core at every parallel region; one thread
    fewer has no such wait. On a quiet machine every thread of the share is used. The reading is the machine's busy
    time less this process tree's own (``read_cpu``), so gcore's threads never count as another's."""

    def __init__(self, ceiling: int, read: Callable[[], CpuReading] = read_cpu,
                 set_threads: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 cores: int | None = None) -> None:
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.ceiling, self.threads, self.cores = ceiling, ceiling, cores or usable_cores()
        self._read, self._set, self._clock = read, set_threads, clock
        self._last, self._at = read(), clock()
        #: other processes' use of this process's cores over the last interval read, in cores
        self.others = 0.0

    def update(self) -> int:
        """Re-read the machine if ``MIN_INTERVAL_S`` passed since the last reading and set the thread count it
        leaves free; returns the thread count in effect."""
        now = self._clock()
        if now - self._at < MIN_INTERVAL_S:
            return self.threads
        reading = self._read()
        elapsed = (reading.total - self._last.total) / self.cores  # seconds of wall time, per core
        if elapsed > 0:
            used = (reading.busy - self._last.busy) - (reading.own - self._last.own)
            self.others = max(0.0, used / elapsed)
            threads = free_threads(self.others, self.cores, self.ceiling)
            if threads != self.threads:
                log.debug("other processes used %.2f of %d cores: %d -> %d torch threads", self.others, self.cores,
                          self.threads, threads)
                self._set(threads)
                self.threads = threads
        self._last, self._at = reading, now
        return self.threads

    def restore(self) -> None:
        """Set the thread count back to ``ceiling`` (after the run: a later one in this process starts from it)."""
        if self.threads != self.ceiling:
            self._set(self.ceiling)
            self.threads = self.ceiling


def governor(device_type: str) -> ThreadGovernor | None:
    """The governor of this controller's torch threads, or ``None`` where gcore keeps the count fixed: on an
    accelerator (its kernels do not run on the OpenMP team), without Linux's ``/proc``, or when the user chose the
    count (``OMP_NUM_THREADS`` in the environment when gcore was imported; a ``torch.set_num_threads(T)`` before
    ``Trainer.fit`` makes ``T`` the most the governor uses)."""
    if device_type != "cpu" or user_threads_at_import is not None or not os.path.exists("/proc/self/stat"):
        return None
    import torch

    return ThreadGovernor(torch.get_num_threads(), read=read_cpu)  # the module's reader at call time (tests swap it)


#: the user's ``OMP_NUM_THREADS`` when gcore was imported (in a controller Fabric launched: when the launching process
#: imported it, ``USER_THREADS_VARIABLE``)
user_threads_at_import = user_threads()


def launching() -> contextlib.AbstractContextManager[None]:
    """Controllers launched inside (Lightning Fabric's launcher) know the user's thread choice from
    ``USER_THREADS_VARIABLE``, not from the ``OMP_NUM_THREADS`` Fabric gives them: their count then adapts as
    this process's does."""
    return environ_set({USER_THREADS_VARIABLE: str(user_threads_at_import or "")})
set_wait_policy()  # on import: gcore's ``__init__`` imports this module before anything imports torch
quiet_torch_cpp_warnings()  # likewise: torch reads TORCH_CPP_LOG_LEVEL once, on import
