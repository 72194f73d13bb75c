"""Tools for multi-turn agents: schemas from plain Python functions, tool-call parsing, and safe calls.

A tool is a typed Python function with a Google-style docstring; :func:`tool_schema` turns it into the JSON
schema a chat template renders (``tokenizer.apply_chat_template(..., tools=[...])``). A
:class:`ToolCallParser` finds the calls in a model's turn and formats each result for the next turn;
:func:`call_tool` runs one call and never raises: an unknown tool, bad arguments, an exception or a timeout
each become a :class:`ToolOutcome` with an ``error`` kind and a message the model can read.

Built-in tools: :func:`calculator` (arithmetic through ``ast``, no ``eval``) and :func:`python` (code in the
subprocess sandbox of :mod:`gcore.envs.sandbox`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import math
import operator
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from gcore.envs.sandbox import SandboxUnavailable, run_python
from gcore.errors import ConfigError


def _qualified_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn`` (``{"type": "function", "function": {...}}``) from its signature and docstring.

    Every argument needs a type hint and a description under ``Args:``; anything missing is a
    :class:`~gcore.errors.ConfigError` naming the function (``module.qualname``) and what is wrong.
    """
    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException, TypeError, ValueError, NameError) as err:
        reason = " ".join(str(arg) for arg in err.args) or type(err).__name__
        reason = " ".join(reason.split())  # one line
        raise ConfigError(f"cannot make a tool of {_qualified_name(fn)}: {reason}") from err


# --- tool calls -------------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    """One call found in a model's turn."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


class ToolCallError(Exception):
    """A malformed tool call in a model's turn; the message is a short reason the model can be shown."""


class ToolError(Exception):
    """A tool that ran and failed (raised by tools; :func:`call_tool` shows it as ``ToolError: message``)."""


class ToolCallParser(ABC):
    """One model family's tool-call format: how calls are written, how results and the tool list are shown."""

    @abstractmethod
    def parse(self, text: str) -> list[ToolCall]:
        """The calls in ``text`` (a model's turn), in order; ``[]`` when it makes none.

        Raises :class:`ToolCallError` with a short reason for a malformed call.
        """

    @abstractmethod
    def format_result(self, name: str, content: str) -> str:
        """How the result of tool ``name`` is shown to the model (the content of the ``tool`` message)."""

    @abstractmethod
    def tools_prompt(self, schemas: list[dict[str, Any]]) -> str:
        """A system-prompt text describing the tools and the call format, for chat templates that do not
        render ``tools=`` themselves."""

    def format_call(self, call: ToolCall) -> str:
        """``call`` written as the model writes it (for worked examples, ``--env.examples``); ``parse`` reads
        it back. Parsers that do not write calls leave this out."""
        raise NotImplementedError(f"the tool-call parser {type(self).__name__} cannot write calls")


class HermesToolCallParser(ToolCallParser):
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format of Hermes, Qwen2.5, Qwen3 and
    SmolLM2: any number of calls in one turn; text without ``<tool_call>`` makes no call.

    A last ``<tool_call>`` without its closing tag is read to the end of the text (generation that stops at
    ``</tool_call>`` leaves the tag out).
    """

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for i, match in enumerate(self._CALL.finditer(text), start=1):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            calls.append(self._parse_one(body.strip(), i))
        return calls

    @staticmethod
    def _parse_one(body: str, i: int) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            raise ToolCallError(f"tool call {i} is not valid JSON: {err.msg} at character {err.pos}") from err
        if not isinstance(obj, dict):
            raise ToolCallError(f"tool call {i} is not a JSON object")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise ToolCallError(f'tool call {i} has no "name" string')
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise ToolCallError(f'tool call {i} ("{name}"): "arguments" is a string that is not JSON') from err
        if not isinstance(arguments, dict):
            raise ToolCallError(f'tool call {i} ("{name}"): "arguments" is not a JSON object')
        return ToolCall(name, arguments)

    def format_call(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"

    def format_result(self, name: str, content: str) -> str:
        """Qwen's rendering of a ``tool`` message (the name is not shown: results follow the calls' order)."""
        return f"<tool_response>\n{content}\n</tool_response>"

    def tools_prompt(self, schemas: list[dict[str, Any]]) -> str:
        """The tools section of Qwen2.5's chat template."""
        listed = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
        return (
            "# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesToolCallParser}


def get_parser(name: str) -> ToolCallParser:
    """A parser by its name in :data:`PARSERS`, or by class path (``my_pkg.parsers.MyParser``)."""
    if name in PARSERS:
        return PARSERS[name]()
    hint = f"valid choices: {', '.join(sorted(PARSERS))} (or a class path such as my_pkg.MyParser)"
    if "." not in name:
        raise ConfigError(f"unknown tool-call parser {name!r}; {hint}")
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot import tool-call parser {name!r}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
        raise ConfigError(f"tool-call parser {name!r} is not a subclass of gcore.envs.tools.ToolCallParser")
    return cls()


# --- calling a tool ---------------------------------------------------------------------------------------


@dataclass
class ToolOutcome:
    """The result of one call as shown to the model; ``error`` is None on success."""

    content: str
    error: Literal["unknown_tool", "bad_arguments", "raised", "timeout"] | None = None


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[... {len(text) - max_chars} more characters cut]"


def _to_text(result: Any) -> str:  # noqa: ANN401  a tool returns anything
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    return str(result)


def call_tool(
    tools: Mapping[str, Callable[..., Any]], call: ToolCall, timeout_s: float, max_chars: int = 4000
) -> ToolOutcome:
    """Run one call and describe what happened; never raises.

    The tool runs in a daemon thread; after ``timeout_s`` this stops waiting and returns a ``timeout`` outcome.
    A function running in this process cannot be killed, so a timed-out call goes on in the background until it
    returns: tools that may run long or hang must limit themselves (the ``python`` tool runs its code in a
    subprocess sandbox with its own limits). Anything the tool raises, ``SystemExit`` and ``KeyboardInterrupt``
    included (they are raised in the worker thread, not by the user), is a ``raised`` outcome. The content (a
    result converted to ``str``, dicts and lists as JSON, or the error message) keeps at most ``max_chars``
    characters, then a note of how many were cut.
    """
    fn = tools.get(call.name)
    if fn is None:
        valid = ", ".join(sorted(tools)) or "(none)"
        return ToolOutcome(_cut(f"unknown tool {call.name!r}; valid tools: {valid}", max_chars), "unknown_tool")
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: let the call itself check
        signature = None
    if signature is not None:
        try:
            signature.bind(**call.arguments)
        except TypeError as err:
            return ToolOutcome(_cut(f"bad arguments for {call.name}: {err}", max_chars), "bad_arguments")

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(**call.arguments)
        except BaseException as err:  # noqa: BLE001  any failure of the tool, SystemExit included, is reported
            box["error"] = err

    worker = threading.Thread(target=run, name=f"tool-{call.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return ToolOutcome(f"tool {call.name} did not finish within {timeout_s:g} s", "timeout")
    if "error" in box:
        raised: BaseException = box["error"]
        try:
            message = str(raised)
        except Exception:  # noqa: BLE001  an exception whose __str__ raises
            message = ""
        kind = type(raised).__name__
        return ToolOutcome(_cut(f"{kind}: {message}" if message else kind, max_chars), "raised")
    try:
        text = _to_text(box.get("result"))
    except Exception as err:  # noqa: BLE001  a result whose __str__ raises
        return ToolOutcome(_cut(f"the result of {call.name} cannot be shown: {type(err).__name__}: {err}",
                                max_chars), "raised")
    return ToolOutcome(_cut(text, max_chars))


# --- built-in tools ---------------------------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPONENT = 1000
_MAX_DIGITS = 1000
_MAX_BITS = math.ceil(_MAX_DIGITS * math.log2(10))
_MAX_EXPRESSION = 2000


def _number(value: Any) -> int | float:  # noqa: ANN401  checked here
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the result is not a real number: {value!r}")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError(f"a number has more than {_MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not finite")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"not a number: {node.value!r}")
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _number(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is over {_MAX_EXPONENT}")
            if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    (abs(left).bit_length() - 1) * right > _MAX_BITS:
                raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
        try:
            return _number(_BINARY[type(node.op)](left, right))
        except OverflowError as err:
            raise ValueError(f"the result is too large: {err}") from err
    what = type(node).__name__
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = type(node.op).__name__
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, e.g. "(3 + 4) * 2 ** 10 / 7".

    Returns:
        The value, as an integer when it is a whole number.
    """
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from err
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value) if isinstance(value, int) else repr(value)


def python(code: str) -> str:
    """Run Python code in a fresh sandboxed process and return what it prints.

    The process has no network and no other processes, a few seconds of CPU, 512 MB of memory and a scratch
    directory that is deleted afterwards; nothing is kept between calls. Print what you want to see.

    Args:
        code: A complete Python program.

    Returns:
        Its standard output, then its standard error (if any).
    """
    return _run_tool(code, "bwrap")


def _run_tool(code: str, sandbox: str) -> str:
    try:
        result = run_python(code, sandbox=sandbox)
    except SandboxUnavailable as err:
        raise ToolError(str(err)) from None
    if result.error is not None:
        raise ToolError(result.error)
    if not result.stderr:
        return result.stdout
    separator = "" if not result.stdout or result.stdout.endswith("\n") else "\n"
    return f"{result.stdout}{separator}[stderr]\n{result.stderr}"


def python_tool(sandbox: str = "bwrap") -> Callable[[str], str]:
    """The ``python`` tool for ``sandbox`` (:data:`gcore.envs.sandbox.SANDBOXES`): :func:`python` itself for
    ``"bwrap"``; for ``"none"`` the same tool (name, schema, docstring) with its code run without isolation."""
    if sandbox == "bwrap":
        return python

    @functools.wraps(python)
    def unisolated(code: str) -> str:
        return _run_tool(code, sandbox)

    return unisolated
