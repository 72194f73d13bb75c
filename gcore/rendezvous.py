"""The rendezvous store of a single-node run, bound to the loopback interface.

torch's ``init_process_group`` has controller 0 host a ``TCPStore`` (no authentication) that
listens on every network interface. A run on one machine needs none of them: here controller 0
opens the store itself on ``127.0.0.1`` and every controller, itself included, joins it as a
client (torch's ``TORCHELASTIC_USE_AGENT_STORE`` mode, in which the launcher owns the store).
Multi-node runs (``--trainer.num_nodes > 1``) and runs whose processes were started by an
outside launcher (torchrun, SLURM) keep torch's default: see docs/failure-modes.md, "Security".
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

from gcore.environ import environ_set
from gcore.errors import ConfigError

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def _spawns_own_processes(fabric) -> bool:  # noqa: ANN001
    env = getattr(fabric.strategy, "cluster_environment", None)
    return env is not None and not env.creates_processes_externally


@contextlib.contextmanager
def loopback_store(fabric, num_nodes: int, timeout_s: float) -> Iterator[object | None]:  # noqa: ANN001
    """Around ``fabric.launch()``: host the store on ``127.0.0.1`` in this process (controller 0 of a
    single-node run that Fabric launches itself); yields the store, or ``None`` where torch's default
    applies. The environment is restored on exit (a later run in this process starts clean)."""
    child = os.environ.get("LOCAL_RANK", "0") != "0"  # a controller launched by this run's controller 0
    if num_nodes > 1 or fabric.world_size == 1 or child or not _spawns_own_processes(fabric):
        yield None
        return
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = fabric.strategy.cluster_environment.main_port  # $MASTER_PORT, or a free port Fabric picks
    try:
        listener.bind(("127.0.0.1", port))
    except OSError as err:
        listener.close()
        if err.errno != errno.EADDRINUSE:
            raise
        if "MASTER_PORT" in os.environ:
            raise ConfigError(f"MASTER_PORT={port} is already in use on this machine (another run or service): "
                              "unset MASTER_PORT and gcore picks a free port, or set another one") from None
        raise ConfigError(f"port {port}, free a moment ago, was taken before the controllers could use it: "
                          "run again (or set MASTER_PORT to a port you keep free)") from None
    listener.listen(512)
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=listener.fileno())
    try:
        # what the launcher passes on to the other controllers, and what torch reads in this one
        with environ_set({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), AGENT_STORE: "True"}):
            yield store
    finally:
        listener.close()
