"""Engine worker processes: the "devices" that placement policies assign roles to (CPU cores, or shares of a GPU).

An engine runtime: ``PoolEngine`` is an ``Engine`` whose ``generate`` runs on worker processes.
Which worker holds which role, and when, is decided by a placement policy; the policies start a
pool through ``gcore/placement/launch.py``.

A ``WorkerPool`` owns ``size`` worker processes (``torch.multiprocessing`` spawn, each with its own
``torch.set_num_threads`` budget, started with ``OMP_NUM_THREADS`` and a passive OpenMP wait policy unless the
user set them: ``gcore/threads.py``, and with a clean environment: ``environment.py``). Their engines run on the
pool's ``device``: the CPU, or the controller's GPU, which the workers then share (each holds its own copy of its
role's model there). Every worker holds one awake *role* at a time: the policy engine (``policy``), the judge
engine (``judge``), both built from the configured, not yet set-up ``Engine`` objects the trainer was given, or a
rule-based reward (``reward``, any ``Scorer``) that scores samples. Changing a worker's role is a real swap: the
old engine is put to sleep and, with ``release=True`` (the CPU default), shut down so its memory is freed; the new
one wakes up, or is loaded again from its checkpoint (the policy then takes the latest weights from shared memory).

One pool serves every controller of a machine (``Peers``): the first controller there (its *owner*)
starts the workers, and every controller, the owner too, connects to each worker and sends it
requests itself; there is no process in between. Requests travel over ``multiprocessing.connection``
(a socket per controller and worker on the loopback interface, authenticated with a key the owner
draws and shares through ``torch.distributed``; every connect, handshake and started read has the deadline
``liveness_timeout_s``, and a stranger's connection is dropped without ending the worker: ``transport.py``), a
transport that runs across machines as it is (a worker would listen on a routable address); today each machine's
pool serves that machine's controllers, since the weights reach the workers through the machine's shared memory.
A worker serves its controllers' requests one at a time, in the order they come. Policy weights go from the owner
to the workers through one shared-memory file in ``/dev/shm`` (no disk, mode 0600, removed however the owner
ends short of a SIGKILL: ``weights.py``): the owner copies its tensors in once (every controller holds the same
weights after a step), every worker copies them into its engine.

Faults: a worker that dies while a controller waits on it is reported in one line naming it, its pid and how it
ended; its request, like one that answers with an error or is not answered within ``job_timeout_s`` (the worker
is then killed), is sent again to another worker of the same role, or to a respawned one; after ``retries``
further attempts the request fails with a ``GcoreError`` and no result of it is used.

The modules: ``jobs`` (requests, answers, ``RoleSpec``, ``Peers``), ``worker`` (the worker process),
``transport`` (connections, authentication, timeouts), ``weights`` (the shared-memory hand-off),
``environment`` (what a worker inherits), ``pool`` (``WorkerPool``), ``engine`` (``PoolEngine``), ``ray_cluster`` (the
workers as actors of a Ray cluster, ``--placement.cluster ray``: docs/cluster.md) and ``ray_weights`` (a Ray worker's
staged weights). None imports
from the floors above (trainer, controller, placement).
"""

from gcore.engines.base import JUDGE, POLICY, REWARD, Role
from gcore.engines.pool.engine import PoolEngine
from gcore.engines.pool.jobs import Job, JobKind, Peers, Reply, ReplyKind, RoleSpec, Scorer
from gcore.engines.pool.pool import WorkerPool, worker_devices
from gcore.engines.pool.weights import SharedWeights

# drives an engine as a worker does, without a process (the engines' own tests)
from gcore.engines.pool.worker import _WorkerRuntime as _WorkerRuntime

__all__ = ["JUDGE", "POLICY", "REWARD", "Job", "JobKind", "Peers", "PoolEngine", "Reply", "ReplyKind", "Role",
           "RoleSpec", "Scorer", "SharedWeights", "WorkerPool", "worker_devices"]
