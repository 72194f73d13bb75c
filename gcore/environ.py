"""Setting environment variables for a while: the variables a block adds are restored (or removed) after it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, MutableMapping


@contextlib.contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` holds ``values`` inside the block; each variable's earlier value (or its absence) is restored
    afterwards, also when the block raises."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


#: the environment variable torch's C++ side reads its log level from, once, when torch is imported
TORCH_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"


def quiet_torch_cpp_warnings(environ: MutableMapping[str, str] = os.environ) -> None:
    """Keep torch's C++ warnings out of a run's output unless the user chose a level (``TORCH_CPP_LOG_LEVEL``):
    when a controller is lost, c10d logs each broken store connection of the others as a warning with a C++ stack
    dump, before gcore's one line that says what happened. Errors still show. gcore's ``__init__`` calls it before
    it imports torch; controllers launched from this process inherit it (in a process that imported torch first,
    it takes effect in those only)."""
    environ.setdefault(TORCH_CPP_LOG_LEVEL, "ERROR")
