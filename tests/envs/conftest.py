"""Fixtures of the environment tests: ``needs_bwrap`` skips a test (with the reason) where the ``python`` tool's
bubblewrap sandbox cannot run: bwrap not installed, or present but unable to make a sandbox here."""

import functools

import pytest

from gcore.envs.sandbox import SandboxUnavailable, check_sandbox


@functools.cache
def _bwrap_problem() -> str | None:
    try:
        check_sandbox("bwrap")
    except SandboxUnavailable as err:
        return str(err)
    return None


@pytest.fixture
def needs_bwrap() -> None:
    problem = _bwrap_problem()
    if problem is not None:
        pytest.skip(f"needs bubblewrap (apt-get install -y -q bubblewrap): {problem}")
