"""Without a usable bubblewrap the ``python`` tool refuses to start, in one line saying what to install, unless
the unsafe option ``--env.python_sandbox none`` is given. bwrap's absence is simulated by pointing
``$GCORE_BWRAP`` (the executable the sandbox looks up) at a name that does not exist; an unusable bwrap (user
namespaces disabled, too old a version) by pointing it at a script that fails the way bwrap does. These tests
need no bubblewrap."""

import pytest

from gcore.envs import sandbox
from gcore.envs.sandbox import BWRAP_ENV, SandboxUnavailable, check_sandbox, run_python
from gcore.envs.tool_env import ToolEnvironment
from gcore.envs.tools import ToolCall, ToolError, call_tool, python, python_tool, tool_schema
from gcore.errors import ConfigError


@pytest.fixture
def no_bwrap(monkeypatch):
    monkeypatch.setenv(BWRAP_ENV, "gcore-no-such-bwrap")


@pytest.fixture
def broken_bwrap(monkeypatch, tmp_path):
    """A bwrap that cannot make namespaces: it fails the way bubblewrap does on a kernel that forbids them."""
    script = tmp_path / "bwrap"
    script.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the "
                      "kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv(BWRAP_ENV, str(script))
    sandbox._probe.cache_clear()
    yield script
    sandbox._probe.cache_clear()


def test_without_bwrap_the_python_tool_refuses_to_start_in_one_line(no_bwrap):
    with pytest.raises(ConfigError) as err:
        ToolEnvironment(tools=["calculator", "python"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("--env.tools python: the python tool's sandbox needs bubblewrap")
    assert "'gcore-no-such-bwrap' is not installed" in message
    assert "apt-get install bubblewrap" in message and "--env.python_sandbox none" in message
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        run_python("print(1)")
    with pytest.raises(ToolError, match="apt-get install bubblewrap"):  # a direct call of the tool
        python("print(1)")


def test_without_bwrap_other_tools_still_start(no_bwrap):
    env = ToolEnvironment(tools=["calculator"])
    assert list(env._functions) == ["calculator"]


def test_the_unsafe_option_runs_the_tool_without_bwrap(no_bwrap, caplog):
    with caplog.at_level("WARNING"):
        env = ToolEnvironment(tools=["python"], python_sandbox="none")
    assert any("--env.python_sandbox none" in r.getMessage() and "without isolation" in r.getMessage()
               for r in caplog.records)
    tool = env._functions["python"]
    assert tool_schema(tool) == tool_schema(python)  # the model sees the same tool
    outcome = call_tool(env._functions, ToolCall("python", {"code": "print(6 * 7)"}), timeout_s=60)
    assert (outcome.content, outcome.error) == ("42\n", None)
    assert python_tool("none")("import sys; print('x', file=sys.stderr)") == "[stderr]\nx\n"


def test_an_unknown_sandbox_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match=r"^--env.python_sandbox 'docker': valid choices: bwrap, none$"):
        ToolEnvironment(tools=["python"], python_sandbox="docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid choices: bwrap, none"):
        run_python("print(1)", sandbox="docker")


def test_a_bwrap_that_cannot_make_a_sandbox_is_one_line(broken_bwrap):
    with pytest.raises(ConfigError) as err:
        ToolEnvironment(tools=["python"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"--env.tools python: bubblewrap ({broken_bwrap}) cannot make a sandbox here: "
                              "bwrap: No permissions to creating new namespace")
    assert "user namespaces" in message and "--env.python_sandbox none" in message
    with pytest.raises(SandboxUnavailable, match="cannot make a sandbox here"):
        run_python("print(1)")  # a run, not only the check, says so
    check_sandbox("none")  # the unsafe way needs nothing
