"""User-facing errors: one clear line, no traceback dump, at the CLI."""

from __future__ import annotations


class GcoreError(Exception):
    """An error caused by the user's input or environment, reported as one line by the CLI."""


class ConfigError(GcoreError):
    """A bad option, plugin name or value."""


class DataError(GcoreError):
    """A dataset that cannot be read; the message names the file and line."""


class RewardError(GcoreError):
    """A reward function raised on a sample; the message names the sample."""


class PluginExit(GcoreError):
    """A plugin's code ended the process (``sys.exit``, its own ``KeyboardInterrupt``, another
    ``BaseException``); the message names the plugin's family, class and method."""


class AlgorithmError(PluginExit):
    """An algorithm's code ended the process (``sys.exit``, its own ``KeyboardInterrupt``); the message names
    the algorithm and the method."""


class PluginError(GcoreError):
    """A plugin that could not be found or imported."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal (SIGINT or SIGTERM, raised by gcore's handler); ``signum`` names it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
