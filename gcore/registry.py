"""Plugin discovery through Python entry points.

Built-ins and third-party plugins are found the same way: each plugin family has an entry-point
group, and ``pip install`` of any package that declares entries in that group makes them available
by name on the command line (``--algorithm grpo``). A plugin that fails to import is reported with
its name and error; the other plugins still load.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from gcore.errors import ConfigError, PluginError

#: plugin family -> entry-point group
GROUPS: dict[str, str] = {
    "engine": "gcore.engines",
    "reward": "gcore.rewards",
    "algorithm": "gcore.algorithms",
    "placement": "gcore.placements",
    "backend": "gcore.backends",
    "env": "gcore.envs",
}


@dataclass(frozen=True)
class PluginInfo:
    """One entry point: its name, where it points, who ships it, and whether it imports."""

    family: str
    name: str
    target: str  # "module:attr"
    package: str  # distribution name and version
    error: str | None = None

    @property
    def class_path(self) -> str:
        return self.target.replace(":", ".")


def _family(family: str) -> str:
    if family not in GROUPS:
        raise PluginError(f"unknown plugin family {family!r}; valid families: {', '.join(GROUPS)}")
    return GROUPS[family]


@lru_cache(maxsize=None)
def discover(family: str) -> tuple[PluginInfo, ...]:
    """All entry points of one family, each tried for import (errors are kept, not raised)."""
    group = _family(family)
    found: dict[str, PluginInfo] = {}
    for ep in md.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        package = f"{dist.name} {dist.version}" if dist is not None else "?"
        error = None
        try:
            ep.load()
        except Exception as err:  # noqa: BLE001  any import failure of a third-party plugin is reported, not fatal
            error = f"{type(err).__name__}: {err}"
        found[ep.name] = PluginInfo(family, ep.name, ep.value, package, error)
    return tuple(sorted(found.values(), key=lambda p: p.name))


def names(family: str) -> list[str]:
    """Names of the plugins of one family that import cleanly."""
    return [p.name for p in discover(family) if p.error is None]


def resolve(family: str, name: str) -> str:
    """Map a plugin name (``grpo``) to its class path; class paths pass through unchanged.

    Raises a ``PluginError`` naming the valid choices for an unknown name, or the import error of
    a plugin that is installed but broken.
    """
    if "." in name:
        return name
    for plugin in discover(family):
        if plugin.name == name:
            if plugin.error:
                raise PluginError(
                    f"{family} plugin {name!r} (from {plugin.package}) failed to import: {plugin.error}"
                )
            return plugin.class_path
    raise PluginError(
        f"unknown {family} {name!r}; valid choices: {', '.join(names(family)) or '(none installed)'}"
        " (or a class path such as my_pkg.MyClass)"
    )


def load(family: str, name: str) -> type:
    """The class registered under ``name`` (or a class path)."""
    path = resolve(family, name)
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise PluginError(f"cannot import {family} class {path!r}: {err}") from err


def load_callable(spec: str, flag: str = "--reward.function") -> Callable:
    """Import ``pkg.module:function`` or ``path/to/file.py:function`` (user code: a reward function, a tool);
    errors name ``flag``."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{flag} {spec!r}: expected 'package.module:function' or 'file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"{flag}: file {module_name} does not exist")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec is not None and module_spec.loader is not None  # a .py file has both
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"{flag} {spec!r} cannot be loaded: {type(err).__name__}: {err}") from err
    if not callable(fn):
        raise ConfigError(f"{flag} {spec!r} is not callable")
    return fn
