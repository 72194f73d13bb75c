"""Telling a user's code that ends the process (``sys.exit``, its own ``KeyboardInterrupt``, any other
``BaseException``) from a real signal, so that gcore can report such code as the plugin's error in one
line instead of letting it end the run with exit status 0 and nothing said."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType

from gcore.errors import Interrupted


def from_signal(err: KeyboardInterrupt) -> bool:
    """Whether ``err`` came from a signal (Ctrl-C, SIGTERM) rather than from user code's own ``raise``.

    Signals reach the main thread only, so a ``KeyboardInterrupt`` in another thread is the code's own.
    In the main thread, gcore's handler (``gcore fit`` installs one) shows in the traceback; under a
    handler that leaves no frame (Python's default) the two cannot be told apart, and the run stops.
    """
    if isinstance(err, Interrupted):
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGINT)
    code = getattr(getattr(handler, "__func__", handler), "__code__", None)
    if code is None:
        return True  # Python's default_int_handler (or no Python-level handler): assume the signal
    tb: TracebackType | None = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def describe(err: BaseException) -> str:
    """``SystemExit: 0``, ``KeyboardInterrupt``: the exception's type and, when it has one, its text."""
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@contextmanager
def ending_as(error: Callable[[BaseException], Exception | None]) -> Iterator[None]:
    """Run user code; a ``BaseException`` that is no ``Exception`` (``SystemExit``, the code's own
    ``KeyboardInterrupt``) is raised as ``error(cause)``, from the cause (or unchanged where ``error``
    gives ``None``: not the user code's). Ordinary exceptions and real signals (``from_signal``) pass
    through unchanged."""
    try:
        yield
    except Exception:
        raise
    except BaseException as err:  # SystemExit and the like: the user code's fault, unless a real signal
        if isinstance(err, KeyboardInterrupt) and from_signal(err):
            raise
        replacement = error(err)
        if replacement is None:
            raise
        raise replacement from err


def culprit(err: BaseException, plugins: Iterable[tuple[str, object]]) -> str | None:
    """``engine MyEngine.generate``: the family, class and method of the innermost frame of ``err``'s
    traceback that runs a method of one of ``plugins`` (pairs of a family and a plugin object), or
    ``None`` when no plugin's method was running."""
    families = {id(plugin): family for family, plugin in plugins if plugin is not None}
    found = None
    tb: TracebackType | None = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in families:
            found = f"{families[id(owner)]} {type(owner).__name__}.{tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return found
