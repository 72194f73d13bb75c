"""Tools for multi-turn agents: schemas from functions, the Hermes tool-call format, safe calls, built-in tools."""

import json
import threading

import pytest

from gcore.envs.tools import (
    PARSERS,
    HermesToolCallParser,
    ToolCall,
    ToolCallError,
    ToolCallParser,
    ToolError,
    ToolOutcome,
    calculator,
    call_tool,
    get_parser,
    python,
    tool_schema,
)
from gcore.errors import ConfigError


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def undocumented(a: int) -> int:
    return a


def untyped(a) -> int:
    """Untyped.

    Args:
        a: A value.
    """
    return a


def half_documented(a: int, b: int) -> int:
    """Only one argument described.

    Args:
        a: The first.
    """
    return a + b


# --- schemas ---------------------------------------------------------------------------------------------


def test_the_schema_of_a_function_has_its_name_description_and_typed_arguments():
    schema = tool_schema(add)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert fn["parameters"]["required"] == ["a"]


@pytest.mark.parametrize("tool", [calculator, python])
def test_the_builtin_tools_have_schemas(tool):
    fn = tool_schema(tool)["function"]
    assert fn["name"] == tool.__name__
    assert list(fn["parameters"]["properties"]) == fn["parameters"]["required"]


@pytest.mark.parametrize(("fn", "reason"), [
    (undocumented, "docstring"),
    (untyped, "type hint"),
    (half_documented, "'b'"),
])
def test_a_function_that_cannot_be_a_tool_is_a_one_line_config_error_naming_it(fn, reason):
    with pytest.raises(ConfigError) as info:
        tool_schema(fn)
    message = str(info.value)
    assert f"{fn.__module__}.{fn.__qualname__}" in message and reason in message
    assert "\n" not in message


# --- the Hermes format -----------------------------------------------------------------------------------


def test_hermes_parses_one_call_several_calls_and_none():
    parser = HermesToolCallParser()
    one = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert parser.parse(one) == [ToolCall("calculator", {"expression": "2+3"})]
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and '
           '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert parser.parse(two) == [ToolCall("add", {"a": 1}), ToolCall("add", {"a": 2, "b": 3})]
    assert parser.parse("The answer is 5.") == []
    assert parser.parse("") == []


def test_hermes_reads_an_unclosed_last_call_arguments_as_a_json_string_and_missing_arguments():
    parser = HermesToolCallParser()
    assert parser.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n') == [ToolCall("add", {"a": 1})]
    assert parser.parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>') == [
        ToolCall("add", {"a": 4})]
    assert parser.parse('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize(("text", "reason"), [
    ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "not a JSON object"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', '"name"'),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', '"arguments" is not a JSON object'),
    ('<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>', '"arguments" is a string that is not JSON'),
    ('<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>oops</tool_call>', "tool call 2"),
])
def test_hermes_raises_a_short_reason_for_a_malformed_call(text, reason):
    with pytest.raises(ToolCallError, match="tool call") as info:
        HermesToolCallParser().parse(text)
    assert reason in str(info.value)


def test_hermes_formats_results_and_the_tools_prompt():
    parser = HermesToolCallParser()
    assert parser.format_result("add", "3") == "<tool_response>\n3\n</tool_response>"
    schemas = [tool_schema(add), tool_schema(calculator)]
    prompt = parser.tools_prompt(schemas)
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.splitlines()] == schemas
    assert "<tool_call>" in prompt and '"arguments"' in prompt


def test_get_parser_by_name_or_class_path_and_the_errors_name_the_choices():
    assert isinstance(get_parser("hermes"), HermesToolCallParser)
    assert PARSERS["hermes"] is HermesToolCallParser
    assert isinstance(get_parser("gcore.envs.tools.HermesToolCallParser"), HermesToolCallParser)
    with pytest.raises(ConfigError, match="valid choices: hermes"):
        get_parser("mistral")
    with pytest.raises(ConfigError, match="cannot import"):
        get_parser("no_such_module.Parser")
    with pytest.raises(ConfigError, match="not a subclass"):
        get_parser("gcore.envs.tools.ToolCall")
    assert issubclass(HermesToolCallParser, ToolCallParser)


# --- calling tools ---------------------------------------------------------------------------------------


def test_a_successful_call_returns_the_result_as_text():
    tools = {"add": add, "listing": lambda: {"a": [1, 2]}}
    assert call_tool(tools, ToolCall("add", {"a": 2, "b": 3}), timeout_s=30) == ToolOutcome("5", None)
    assert call_tool(tools, ToolCall("listing", {}), timeout_s=30) == ToolOutcome('{"a": [1, 2]}', None)


def test_an_unknown_tool_names_the_valid_tools():
    outcome = call_tool({"add": add, "calculator": calculator}, ToolCall("search", {}), timeout_s=30)
    assert outcome.error == "unknown_tool"
    assert "'search'" in outcome.content and "add, calculator" in outcome.content


@pytest.mark.parametrize(("arguments", "problem"), [
    ({}, "missing a required argument: 'a'"),
    ({"a": 1, "c": 2}, "unexpected keyword argument 'c'"),
])
def test_bad_arguments_name_the_problem(arguments, problem):
    outcome = call_tool({"add": add}, ToolCall("add", arguments), timeout_s=30)
    assert outcome.error == "bad_arguments"
    assert problem in outcome.content


def _raises_value_error(x: int) -> int:
    raise ValueError(f"no good: {x}")


def _exits() -> None:
    raise SystemExit(2)


def _interrupts() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(("fn", "arguments", "content"), [
    (_raises_value_error, {"x": 7}, "ValueError: no good: 7"),
    (_exits, {}, "SystemExit: 2"),
    (_interrupts, {}, "KeyboardInterrupt"),
])
def test_whatever_a_tool_raises_is_a_raised_outcome(fn, arguments, content):
    outcome = call_tool({"t": fn}, ToolCall("t", arguments), timeout_s=30)
    assert outcome == ToolOutcome(content, "raised")


def test_a_tool_past_its_timeout_is_a_timeout_outcome():
    release = threading.Event()
    started = threading.Event()

    def hangs() -> str:
        started.set()
        release.wait(60)
        return "late"

    try:
        outcome = call_tool({"hangs": hangs}, ToolCall("hangs", {}), timeout_s=0.2)
    finally:
        release.set()  # let the abandoned thread finish
    assert started.is_set()
    assert outcome.error == "timeout" and "0.2 s" in outcome.content


def test_long_results_and_messages_are_cut_to_max_chars():
    outcome = call_tool({"big": lambda: "x" * 10_000}, ToolCall("big", {}), timeout_s=30, max_chars=100)
    assert outcome.error is None
    assert outcome.content.startswith("x" * 100) and not outcome.content.startswith("x" * 101)
    assert "9900 more characters cut" in outcome.content

    def loud() -> None:
        raise RuntimeError("y" * 10_000)

    outcome = call_tool({"loud": loud}, ToolCall("loud", {}), timeout_s=30, max_chars=100)
    assert outcome.error == "raised" and len(outcome.content) < 200


# --- built-in tools --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("expression", "value"), [
    ("2 + 3 * 4", "14"),
    ("(2 + 3) * 4", "20"),
    ("7 / 2", "3.5"),
    ("4 / 2", "2"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("-(2 ** 10)", "-1024"),
    ("2 ** -1", "0.5"),
    ("1.5 * 2", "3"),
    ("0.1 + 0.2", "0.30000000000000004"),
    ("2 ** 1000", str(2**1000)),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "reason"), [
    ("x + 1", "Name"),
    ("__import__('os').system('true')", "Call"),
    ("abs(-1)", "Call"),
    ("True + 1", "not a number"),
    ("'a' * 3", "not a number"),
    ("1 if 1 else 2", "IfExp"),
    ("1 << 2", "LShift"),
    ("2 ** 100000", "exponent"),
    ("(10 ** 999) ** 2", "digits"),
    ("10 ** 999 * 10 ** 999", "digits"),
    ("10.0 ** 400", "too large"),
    ("1e308 * 10", "not finite"),
    ("(-8) ** 0.5", "not a real number"),
    ("2 +", "not an arithmetic expression"),
    ("1; 2", "not an arithmetic expression"),
    ("1" * 3000, "longer than"),
])
def test_the_calculator_refuses_what_is_not_plain_arithmetic(expression, reason):
    with pytest.raises(ValueError, match=reason):
        calculator(expression)


def test_calculator_division_by_zero_reaches_the_model_as_a_raised_outcome():
    outcome = call_tool({"calculator": calculator}, ToolCall("calculator", {"expression": "1/0"}), timeout_s=30)
    assert outcome == ToolOutcome("ZeroDivisionError: division by zero", "raised")


@pytest.mark.usefixtures("needs_bwrap")
def test_the_python_tool_returns_stdout_and_stderr():
    assert python("print(2 + 3)") == "5\n"
    assert python("import sys\nprint('a')\nprint('b', file=sys.stderr)") == "a\n[stderr]\nb\n"


@pytest.mark.usefixtures("needs_bwrap")
def test_the_python_tool_raises_a_tool_error_with_the_sandbox_error():
    with pytest.raises(ToolError, match="exit code 1: NameError"):
        python("print(undefined_name)")
    outcome = call_tool({"python": python}, ToolCall("python", {"code": "import os\nos.system('ls')"}), timeout_s=60)
    assert outcome.error == "raised"
    assert outcome.content.startswith("ToolError: exit code 1: PermissionError: sandbox: os.system")
