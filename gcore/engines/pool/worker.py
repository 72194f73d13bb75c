"""An engine worker process: it builds its role's engine, says where it listens, takes its controllers'
connections (``transport.WorkerListener``: each authenticated within the timeout, a stranger dropped without
ending the worker), then serves their requests one at a time until told to stop or every controller is gone."""

# the role names and request kinds are Literal types: comparing one with another spelling is an error
# mypy: strict-equality

from __future__ import annotations

import gc
import logging
import os
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, assert_never, cast

import torch

from gcore.engines.base import POLICY, Engine, Role
from gcore.engines.pool.jobs import JobKind, Reply, RoleSpec, Scorer
from gcore.engines.pool.transport import WorkerListener
from gcore.engines.pool.weights import open_weights
from gcore.errors import GcoreError
from gcore.types import Generation, Sample, SamplingParams, VisualInputs

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

#: the first item of every request a worker takes
REQUESTS = frozenset({"generate", "logprobs", "token_logprobs", "score", "role", "sync", "stop"})

#: test only (tests/trainer/test_partial_rollouts.py): a count of tokens N. A partial rollout's generation that has
#: sampled N tokens with no weight update yet waits there for the update (at most ``HOLD_GUARD_S``), so that a test's
#: cut is certain whatever the machine's speed; the worker's first partial request (the run's first step, generated
#: with no update to come) is not held. Unset or 0: no hold (every real run).
HOLD_ENV = "GCORE_TEST_PARTIAL_HOLD"
HOLD_GUARD_S = 120.0


def worker_main(index: int, threads: int, seed: int, specs: bytes, role: Role, weights: tuple | None,
                release: bool, device: str, clients: int, authkey: bytes, startup: Connection,
                timeout_s: float = 30.0) -> None:
    """The worker's life: build its engine, say on ``startup`` (the owner's pipe) that it is ready and
    where it listens, take its ``clients`` controllers' connections (each authenticated within ``timeout_s``;
    it stops waiting when the owner, its parent, is gone), then serve their requests one at a time until told
    to stop or every controller is gone. A request is ``(kind, job id, *args)`` (``("stop", None)`` ends the
    worker); each is answered on the connection it came on."""
    try:
        runtime, listener = start_worker(index, threads, seed, specs, role, weights, release, device, authkey,
                                         timeout_s)
    except BaseException:  # noqa: BLE001  report why it could not start, whatever it was, then exit
        _send(startup, ("fatal", index, None, traceback.format_exc()))
        return
    _send(startup, ("ready", index, None, listener.address))
    parent = os.getppid()
    serve_worker(index, runtime, listener, clients, keep_waiting=lambda: os.getppid() == parent)
    gc.freeze()  # the process ends next: skip the interpreter's last full collection (``gcore.cli.entry``)


def start_worker(index: int, threads: int, seed: int, specs: bytes, role: Role, weights: tuple | None,
                 release: bool, device: str, authkey: bytes, timeout_s: float = 30.0,
                 host: str = "127.0.0.1") -> tuple[_WorkerRuntime, WorkerListener]:
    """A worker's first half: its engine built in ``role`` and its listener on ``host`` (``worker_main``'s, and a Ray
    actor's: ``ray_cluster.py``). Raises whatever stopped it."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    runtime = _WorkerRuntime(pickle.loads(specs), release, torch.device(device))
    try:
        runtime.switch(role, weights)
        return runtime, WorkerListener(authkey, timeout_s, f"engine worker {index}", host)
    except BaseException:
        runtime.shutdown()
        raise


def serve_worker(index: int, runtime: _WorkerRuntime, listener: WorkerListener, clients: int,
                 keep_waiting: Callable[[], bool]) -> None:
    """A worker's second half: take its ``clients`` controllers' connections (as long as ``keep_waiting()``), serve
    them until a ``stop`` or until none is left, then shut its engines down."""
    try:  # the engines are shut down however the worker ends: an engine's own processes (SGLang's) would
        # otherwise keep it alive (multiprocessing joins them at exit)
        controllers = listener.accept(clients, keep_waiting=keep_waiting)
        _serve_controllers(index, runtime, controllers)
    finally:
        runtime.shutdown()


def _serve_controllers(index: int, runtime: _WorkerRuntime, controllers: list[Connection]) -> None:
    """Serve the controllers' requests in the order they come, until a ``stop`` or until none is left."""
    from multiprocessing.connection import wait

    while controllers:
        for conn in cast("list[Connection]", wait(controllers)):
            message = _receive(index, conn)
            if message is None:  # that controller is gone, or sent what is not a request
                controllers.remove(conn)
                conn.close()
                continue
            if message[0] == "stop":
                return
            if not _answer(index, runtime, conn, message):  # that controller is gone
                controllers.remove(conn)
                conn.close()


def _receive(index: int, conn: Connection) -> tuple | None:
    """A controller's next request, or ``None`` when its connection is closed, broken, or carries what is not a
    request (logged: the worker goes on serving its other controllers)."""
    try:
        message = conn.recv()
    except (EOFError, OSError):  # gone, or a message cut short (a read waits at most the timeout)
        return None
    except Exception as err:  # noqa: BLE001  what cannot be read is dropped with its connection, not the worker
        log.warning("engine worker %d (pid %d): dropped a controller connection that sent what cannot be read: %s",
                    index, os.getpid(), f"{type(err).__name__}: {err}".splitlines()[0])
        return None
    if not (isinstance(message, tuple) and len(message) >= 2 and message[0] in REQUESTS):
        log.warning("engine worker %d (pid %d): dropped a controller connection that sent a %s, not a request",
                    index, os.getpid(), type(message).__name__)
        return None
    return message


def _answer(index: int, runtime: _WorkerRuntime, conn: Connection, message: tuple) -> bool:
    """Serve one request and answer it on ``conn``; ``False`` when that connection is gone."""
    kind: JobKind = message[0]
    job_id: int = message[1]

    def take_sync() -> None:
        """A partial rollout's weight update, sent while its generation ran: load it and answer it."""
        update = conn.recv()
        if update[0] != "sync":
            raise GcoreError(f"engine worker {index}: a {update[0]!r} request came during a partial "
                             "rollout (only a weight sync may)")
        started = time.perf_counter()
        try:
            loaded = runtime.sync(*update[2:])
        except Exception:  # answered, or the controller waits for this sync forever; the generate fails
            _send(conn, ("error", index, update[1], traceback.format_exc()))
            raise
        _send(conn, ("result", index, update[1], (loaded, time.perf_counter() - started)))

    try:
        started = time.perf_counter()
        result = _serve(runtime, kind, message[2:], conn.poll, take_sync)
        reply: Reply = ("result", index, job_id, (result, time.perf_counter() - started))
    except Exception:  # noqa: BLE001  an engine may fail in any way: the pool retries or reports it
        reply = ("error", index, job_id, traceback.format_exc())
    try:
        _send(conn, reply)
    except OSError:
        return False
    return True


def _send(replies: Connection, reply: Reply) -> None:
    """Answer the pool (a ``Reply``: its kind is checked where it is written)."""
    replies.send(reply)


def _serve(runtime: _WorkerRuntime, kind: JobKind, args: tuple, pending: Callable[..., bool] = lambda *_: False,
           take_sync: Callable[[], None] = lambda: None) -> object:
    """One request in the worker: its result, which the pool reads as ``kind`` says. ``pending``: whether another
    request came meanwhile; ``take_sync``: serve it, a weight update (partial rollouts: ``generate`` with
    ``partial``)."""
    if kind == "generate":  # (role, prompts, params[, seed or None[, each prompt's visual inputs or None[, partial]]])
        role, prompts, params, *extra = args
        seed, visual, partial = (*extra, None, None, False)[:3]
        if partial:  # True, or a test's word on holding it (``HOLD_ENV``): "hold" or "free"
            return runtime.generate_partial(role, prompts, params, seed, visual, pending, take_sync,
                                            None if partial is True else partial == "hold")
        return runtime.generate(role, prompts, params, seed, visual)
    if kind == "logprobs":  # (role, prompts, candidates[, each prompt's visual inputs or None])
        role, prompts, candidates, *extra = args
        visual = extra[0] if extra else None
        return runtime.next_token_logprobs(role, prompts, candidates, visual)
    if kind == "token_logprobs":  # (role, sequences, temperature, each sequence's start)
        role, sequences, temperature, starts = args
        return runtime.token_logprobs(role, sequences, starts, temperature)
    if kind == "score":
        return runtime.score(*args)
    if kind == "role":
        return runtime.switch(*args)
    if kind == "sync":
        (weights,) = args
        return runtime.sync(weights)
    assert_never(kind)


class _WorkerRuntime:
    """Inside a worker: its engines, which one is awake, and how roles are swapped."""

    def __init__(self, specs: dict[Role, RoleSpec], release: bool, device: torch.device) -> None:
        self.specs, self.release, self.device = specs, release, device
        self.engines: dict[Role, Engine | Scorer] = {}
        self.role: Role | None = None
        self.weights: tuple | None = None  # the latest policy weights sent (``weights.open_weights`` reads it)
        self.partial_served = 0  # partial rollouts' generate requests served (``HOLD_ENV``)
        self.hold = int(os.environ.get(HOLD_ENV, "0") or 0)

    def _engine(self, role: Role) -> Engine:
        """The engine ``role`` holds (not a rule-based reward's)."""
        held = self.engines[role]
        if not isinstance(held, Engine):
            raise RuntimeError(f"the {role} role holds a rule-based reward, not an engine")
        return held

    def _load(self, role: Role, weights: tuple | None) -> Engine | Scorer:
        spec = self.specs[role]
        if spec.reward is not None:
            reward = pickle.loads(pickle.dumps(spec.reward))
            reward.setup(torch.device("cpu"))  # rule-based: Python on the CPU
            return reward
        engine = pickle.loads(pickle.dumps(spec.engine))  # a fresh copy of the configured engine
        assert spec.source is not None, f"the {role} role has an engine but no ModelSource"
        engine.setup(spec.source, self.device)
        if role == POLICY and weights is not None:
            engine.update_weights(open_weights(weights))
        return engine

    def switch(self, role: Role, weights: tuple | None) -> tuple[Role, ...]:
        """Make ``role`` the awake engine (sleep/release the other one); returns the engines held.
        ``weights``: the latest policy weights (``None``: the latest this worker was sent)."""
        self.weights = weights or self.weights
        weights = self.weights
        if role == self.role:
            return tuple(sorted(self.engines))
        if self.role is not None:
            old = self.engines[self.role]
            if isinstance(old, Engine):
                old.sleep()
            if self.release:
                if isinstance(old, Engine):
                    old.shutdown()
                del self.engines[self.role]
        if role in self.engines:
            held = self.engines[role]
            if isinstance(held, Engine):
                held.wake_up()
            if role == POLICY and weights is not None:
                self._engine(role).update_weights(open_weights(weights))
        else:
            self.engines[role] = self._load(role, weights)
        self.role = role
        return tuple(sorted(self.engines))

    def _take(self, role: Role) -> None:
        """A request for another role than the awake one swaps first. The controllers change roles with ``role``
        requests where none of them has requests in flight; a request still on its way when another controller
        changed the split (rollouts that overlap training) is served, not refused."""
        if role != self.role:
            log.info("engine worker holds the %s role, swapping to serve a %s request", self.role, role)
            self.switch(role, None)

    def generate(self, role: Role, prompts: list[list[int]], params: SamplingParams,
                 seed: int | None = None, visual: list[VisualInputs | None] | None = None) -> list[list[Generation]]:
        """Sample with the ``role`` engine; with a ``seed``, from a random state drawn from it alone (not from
        what this worker sampled before), so that a request samples the same wherever and whenever it runs.
        ``visual``: each prompt's images (image prompts)."""
        self._take(role)
        if seed is not None:
            torch.manual_seed(seed)
        if visual is None:
            return self._engine(role).generate(prompts, params)
        return self._engine(role).generate(prompts, params, visual=visual)

    def generate_partial(self, role: Role, prompts: list[list[int]], params: SamplingParams, seed: int | None,
                         visual: list[VisualInputs | None] | None, pending: Callable[..., bool],
                         take_sync: Callable[[], None], hold: bool | None = None) -> list[list[Generation]]:
        """``generate`` as a partial rollout: when a weight update comes during it (``pending``), the engine stops
        between tokens, the update is loaded (``take_sync``), and every unfinished generation continues from its
        tokens with the new weights (its prompt and tokens prefilled again: the KV cache of the old weights is not
        kept), one more version per update (``Generation.versions``). No token is thrown away. ``pending(timeout)``:
        whether the update came, waiting up to ``timeout`` seconds for it (only with ``HOLD_ENV``, a test's).
        ``hold``: whether ``HOLD_ENV`` holds this request (the controller says so for an episode's turns, which only it
        can tell apart); ``None``: every request but the worker's first."""
        self._take(role)
        engine = self._engine(role)
        if not engine.capabilities.interrupt:
            return self.generate(role, prompts, params, seed, visual)
        self.partial_served += 1
        tokens = self.hold if (self.partial_served > 1 if hold is None else hold) else 0
        asked, updated = 0, False

        def interrupt() -> bool:  # asked between two decoding steps
            nonlocal asked, updated
            asked += 1
            if pending():
                updated = True
                return True
            if asked == tokens and not updated:  # test only: wait here for the first update (``HOLD_ENV``)
                if pending(HOLD_GUARD_S):
                    updated = True
                    return True
                log.warning("engine worker: no weight update came within %.0f s of a held partial rollout (%s)",
                            HOLD_GUARD_S, HOLD_ENV)
            return False

        engine.interrupt = interrupt
        try:
            out = self.generate(role, prompts, params, seed, visual)
            budget, loads = params.max_new_tokens, 0

            def cut_short(g: Generation) -> bool:  # stopped by an update: neither finished nor at the budget
                return not g.finished and len(g.token_ids) < budget

            cut = [(i, j) for i, row in enumerate(out) for j, g in enumerate(row) if cut_short(g)]
            while cut:
                take_sync()  # the update is there: it is what stopped the engine
                loads += 1
                for left in sorted({budget - len(out[i][j].token_ids) for i, j in cut}):
                    group = [(i, j) for i, j in cut if budget - len(out[i][j].token_ids) == left]
                    more = self.generate(role, [prompts[i] + out[i][j].token_ids for i, j in group],
                                         replace(params, n=1, max_new_tokens=left), None,
                                         None if visual is None else [visual[i] for i, _ in group])
                    for (i, j), (extra,) in zip(group, more, strict=True):
                        g = out[i][j]
                        versions = (g.versions or [0] * len(g.token_ids)) + [loads] * len(extra.token_ids)
                        out[i][j] = Generation(g.token_ids + extra.token_ids, g.logprobs + extra.logprobs,
                                               extra.finished, versions)
                cut = [(i, j) for i, j in cut if cut_short(out[i][j])]
            return out
        finally:
            engine.interrupt = None

    def next_token_logprobs(self, role: Role, prompts: list[list[int]], candidates: list[int],
                            visual: list[VisualInputs | None] | None = None) -> list[list[float]]:
        """The ``role`` engine's next-token log-probabilities of ``candidates``; ``visual``: each prompt's images
        (a VLM judge's ``probability`` verdict on image prompts), passed only when given, as ``generate`` does."""
        self._take(role)
        if visual is None:
            return self._engine(role).next_token_logprobs(prompts, candidates)
        return self._engine(role).next_token_logprobs(prompts, candidates, visual=visual)

    def token_logprobs(self, role: Role, sequences: list[list[int]], starts: list[int],
                       temperature: float) -> list[list[float]]:
        """The ``role`` engine's log-probabilities of the given tokens of each sequence from its start on (an
        on-policy distillation teacher's, ``Engine.token_logprobs``)."""
        self._take(role)
        return self._engine(role).token_logprobs(sequences, starts, temperature)

    def score(self, role: Role, samples: list[Sample]) -> tuple[list[float], int]:
        """The reward of each sample, and how many failed (``Scorer.last_errors``)."""
        self._take(role)
        reward = self.engines[role]
        if isinstance(reward, Engine):
            raise RuntimeError(f"the {role} role holds an engine, not a rule-based reward")
        return reward.score(samples), reward.last_errors

    def shutdown(self) -> None:
        """Shut down every engine held (the worker ends)."""
        for held in self.engines.values():
            if isinstance(held, Engine):
                held.shutdown()

    def sync(self, weights: tuple) -> int:
        self.weights = weights
        if POLICY not in self.engines:  # released: it loads the latest weights when it wakes up
            return 0
        return self._engine(POLICY).update_weights(open_weights(weights))
