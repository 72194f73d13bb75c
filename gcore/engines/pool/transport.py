"""The pool's connections: a worker's listener, a controller's connect, and their timeouts.

Every connection between a controller and an engine worker is a loopback socket wrapped in a
``multiprocessing.connection.Connection``, authenticated both ways with the pool's key (the standard library's
HMAC challenge, done before any pickle is read). What the standard library leaves open, and what is added here:

- **a deadline on every handshake.** ``Listener.accept`` authenticates in the accepting thread with no timeout:
  a local process that connects to a worker's port first and stays silent holds the worker, and the controller
  waiting behind it in the listen backlog, for as long as it likes. Here the worker authenticates each connection
  in a thread of its own (``WorkerListener``), with ``SO_RCVTIMEO``/``SO_SNDTIMEO`` on the socket, so a silent
  client is dropped after the timeout and never delays another;
- **a connection that fails authentication or sends garbage is dropped and logged**, not raised: the worker goes
  on accepting its controllers (``Listener.accept`` raised ``AuthenticationError``, which ended the worker);
- **a deadline on every connect** (``connect``): the controller gives up after the timeout, and while it waits it
  asks whether the worker is still alive, so a worker that dies meanwhile is named at once;
- **a deadline on every receive**: an established connection keeps ``SO_RCVTIMEO``, so a read that has started (a
  peer frozen in the middle of a message) fails after the timeout instead of blocking for ever. Waiting for the
  next message is not bounded here (``multiprocessing.connection.wait`` is called with the caller's timeout).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from queue import Empty, Queue

from gcore.errors import GcoreError

log = logging.getLogger(__name__)

#: at most this many connections are being authenticated at once in one worker; more are closed at once
MAX_HANDSHAKES = 32
#: how often a waiting controller (or worker) looks at whether the other side is still there
POLL_S = 0.25

Address = tuple[str, int]


def set_timeouts(fd: int, recv_s: float, send_s: float) -> None:
    """``SO_RCVTIMEO``/``SO_SNDTIMEO`` of the socket ``fd`` (0: none): a blocking read or write that waits longer
    fails with an ``OSError`` (``EAGAIN``). The descriptor stays blocking, as ``Connection`` needs it."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        for option, seconds in ((socket.SO_RCVTIMEO, recv_s), (socket.SO_SNDTIMEO, send_s)):
            whole = int(seconds)
            sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("@ll", whole, int((seconds - whole) * 1e6)))
    finally:
        sock.close()


def first_line(err: BaseException) -> str:
    """An error in one line: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class WorkerListener:
    """A worker's listening socket, on the loopback interface (``host``; a worker of a Ray cluster listens on its
    node's address, ``gcore/engines/pool/ray_cluster.py``): ``accept`` returns its ``clients`` authenticated
    controller connections.

    Each connection is authenticated in a thread of its own within ``timeout_s`` (``SO_RCVTIMEO`` and
    ``SO_SNDTIMEO`` on its socket); one that stays silent, fails the challenge or sends garbage is logged as
    dropped and closed, and the listener goes on. ``dropped`` counts them.
    """

    def __init__(self, authkey: bytes, timeout_s: float, name: str, host: str = "127.0.0.1") -> None:
        self.authkey, self.timeout_s, self.name = authkey, timeout_s, name
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self._sock.settimeout(POLL_S)  # the accept loop looks at ``_closed`` between connections
        self.address: Address = self._sock.getsockname()
        self.dropped = 0
        self._accepted: Queue[Connection] = Queue()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def accept(self, clients: int, keep_waiting: Callable[[], bool] = lambda: True) -> list[Connection]:
        """The first ``clients`` authenticated connections; waits as long as ``keep_waiting()`` says (asked every
        ``POLL_S``), then returns those it has. The listener is closed afterwards: nothing else can connect."""
        connections: list[Connection] = []
        try:
            while len(connections) < clients and keep_waiting():
                try:
                    connections.append(self._accepted.get(timeout=POLL_S))
                except Empty:
                    continue
        finally:
            self.close()
        return connections

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        while not self._accepted.empty():  # authenticated after the last one wanted: not served
            self._accepted.get_nowait().close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            if not self._handshakes.acquire(blocking=False):
                self._drop(peer, f"more than {MAX_HANDSHAKES} connections were authenticating at once")
                sock.close()
                continue
            threading.Thread(target=self._authenticate, args=(sock, peer), name=f"{self.name}-auth",
                             daemon=True).start()

    def _authenticate(self, sock: socket.socket, peer: Address) -> None:
        try:
            sock.settimeout(None)
            set_timeouts(sock.fileno(), self.timeout_s, self.timeout_s)
            conn = Connection(sock.detach())
        except OSError as err:
            sock.close()
            self._handshakes.release()
            self._drop(peer, first_line(err))
            return
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            set_timeouts(conn.fileno(), self.timeout_s, 0)  # each read of an established connection is bounded
        except Exception as err:  # noqa: BLE001  untrusted input: whatever it sent, the connection alone goes
            conn.close()
            self._drop(peer, _why_handshake_failed(err, self.timeout_s))
            return
        finally:
            self._handshakes.release()
        if self._closed.is_set():
            conn.close()
        else:
            self._accepted.put(conn)

    def _drop(self, peer: Address, why: str) -> None:
        self.dropped += 1
        log.warning("%s (pid %d): dropped a connection from %s:%d: %s", self.name, os.getpid(), peer[0], peer[1],
                    why)


def _why_handshake_failed(err: BaseException, timeout_s: float) -> str:
    if isinstance(err, BlockingIOError | TimeoutError):
        return f"it did not complete the authentication handshake within {timeout_s:g}s"
    if isinstance(err, EOFError):
        return "it closed the connection during the authentication handshake"
    return f"it failed authentication ({first_line(err)})"


def connect(address: Address, authkey: bytes, timeout_s: float, name: str,
            gone: Callable[[], str | None] = lambda: None) -> Connection:
    """A controller's authenticated connection to a worker listening at ``address``, or a one-line ``GcoreError``
    naming ``name`` (the worker, with its pid) and why: the worker is gone (``gone()``, asked every ``POLL_S``,
    returns why, e.g. its exit status), refused the key, or did not complete the handshake within ``timeout_s``."""
    where = f"{name} at {address[0]}:{address[1]}"
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection(address, timeout=timeout_s)
    except OSError as err:
        why = gone()
        raise GcoreError(f"{where}: {why or 'cannot be connected to'} ({first_line(err)})") from err
    try:
        sock.settimeout(None)
        set_timeouts(sock.fileno(), timeout_s, timeout_s)
        conn = Connection(sock.detach())
    except OSError as err:
        sock.close()
        raise GcoreError(f"{where}: cannot be connected to ({first_line(err)})") from err
    try:
        while not conn.poll(POLL_S):  # the worker's challenge
            why = gone()
            if why is not None:
                raise GcoreError(f"{where} {why} while this controller was connecting to it")
            if time.monotonic() > deadline:
                raise GcoreError(f"{where} did not start the authentication handshake within {timeout_s:g}s "
                                 "(the worker is frozen, or overloaded)")
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        set_timeouts(conn.fileno(), timeout_s, 0)
    except GcoreError:
        conn.close()
        raise
    except Exception as err:
        conn.close()
        why = gone()
        raise GcoreError(f"{where}: {why or 'the authentication handshake failed'} ({first_line(err)})") from err
    return conn
