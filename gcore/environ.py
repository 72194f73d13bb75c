"""Setting environment variables for a while: the variables a block adds are restored (or removed) after it."""

from __future__ import annotations

import contextlib
import os
import sys
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


#: the folder that holds this gcore package (site-packages, or a source checkout's root)
_GCORE_PARENT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


@contextlib.contextmanager
def children_import_this_gcore() -> Iterator[None]:
    """Processes started inside (``multiprocessing`` spawn or forkserver) import this gcore, not a folder named
    ``gcore`` elsewhere on their path.

    The case it mends: an editable install reaches gcore through an import hook, not through a ``sys.path``
    folder, so where a folder of the path holds a ``gcore`` folder of its own (``python -m gcore`` and the
    forkserver's ``python -c`` put the working directory first, and ``--trainer.default_root_dir .`` writes runs
    to ``./gcore/``), a child imports that folder as a namespace package and fails at its first
    ``from gcore import ...``. Where the working directory or a folder of the path holds such a folder, inside
    the block the folder that holds this gcore is on ``sys.path`` (spawn children take it from there) and on
    ``PYTHONPATH`` (the forkserver of Python 3.11 starts from that, not from this process's path): a regular
    package anywhere on the path wins over a namespace folder. Otherwise nothing changes."""
    ours = os.path.join(_GCORE_PARENT, "gcore")
    folders = {os.path.realpath(os.path.join(entry or os.getcwd(), "gcore")) for entry in ["", *sys.path]}
    if not any(os.path.isdir(folder) and folder != ours for folder in folders):
        yield
        return
    sys.path.insert(0, _GCORE_PARENT)
    python_path = os.pathsep.join(filter(None, [_GCORE_PARENT, os.environ.get("PYTHONPATH")]))
    try:
        with environ_set({"PYTHONPATH": python_path}):
            yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(_GCORE_PARENT)


#: the environment variable torch's C++ side reads its log level from, once, when torch is imported
TORCH_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"


def quiet_torch_cpp_warnings(environ: MutableMapping[str, str] = os.environ) -> None:
    """Keep torch's C++ warnings out of a run's output unless the user chose a level (``TORCH_CPP_LOG_LEVEL``):
    when a controller is lost, c10d logs each broken store connection of the others as a warning with a C++ stack
    dump, before gcore's one line that says what happened. Errors still show. gcore's ``__init__`` calls it before
    it imports torch; controllers launched from this process inherit it (in a process that imported torch first,
    it takes effect in those only)."""
    environ.setdefault(TORCH_CPP_LOG_LEVEL, "ERROR")
