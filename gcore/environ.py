"""Setting environment variables for a while: the variables a block adds are restored (or removed) after it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


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
