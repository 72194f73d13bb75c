"""``tools``: an environment made of plain Python functions the model calls (docs/agents.md).

The model sees the tools (their JSON schemas, built from each function's signature and docstring)
in its chat template's ``tools=`` when the template renders them, or else in a system message that
describes them and the call format. Each model turn either calls tools, in its family's format
(``--env.parser hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5,
Qwen3, Hermes and SmolLM2 write them), or answers: a turn with no call ends the episode, and the
reward model scores that answer. A malformed call, an unknown tool, bad arguments, a tool that
raises or runs past ``--env.tool_timeout_s`` become an error result that the model sees, counted in
``env/tool_errors``; the run goes on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Literal

from gcore.envs import tools as builtin
from gcore.envs.base import Environment, Turn
from gcore.envs.sandbox import SandboxUnavailable, check_sandbox
from gcore.envs.tools import ToolCall, ToolCallError, call_tool, get_parser, tool_schema
from gcore.errors import ConfigError
from gcore.registry import load_callable
from gcore.types import Prompt

log = logging.getLogger(__name__)

#: the built-in tools, by the name ``--env.tools`` takes
BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": builtin.calculator, "python": builtin.python}


class ToolEnvironment(Environment):
    """Tools the model calls; the episode ends at the first turn without a call.

    Args:
        tools: built-in tools (``calculator``; ``python``, which runs code in a sandboxed process)
            and your own functions (``pkg.module:function`` or ``file.py:function``; typed, with a
            Google-style docstring that describes every argument).
        parser: how tool calls are written: ``hermes`` or a ``ToolCallParser`` class path.
        tool_prompt: where the tools are described: ``template`` (the chat template's ``tools=``;
            a template that does not render them is an error), ``system`` (a system message of
            gcore's, with the parser's call format), ``auto`` (``template`` where it renders them).
        system_prompt: text put before the tools' description in that system message.
        examples: worked examples shown before each question, as earlier turns of the conversation (few-shot):
            a ``.jsonl`` file, one example a line, ``{"prompt": ..., "calls": [{"name": ..., "arguments":
            {...}}], "answer": ...}``. gcore writes the calls in the parser's format and runs them with the
            tools, so each example's results are the tools' own.
        tool_timeout_s: a call that does not return in this time is an error result.
        max_result_chars: a tool's result is cut to this many characters.
        python_sandbox: how the ``python`` tool isolates its code: ``bwrap`` (bubblewrap: namespaces of its
            own, a read-only minimal file system, no network; docs/agents.md), or ``none``: a plain
            subprocess, UNSAFE (the code can read and write whatever the trainer can). With ``bwrap``, a
            missing or unusable bubblewrap is an error when the environment is made.
        max_turns, max_tokens, workers, timeout_s, overlap, isolation, max_observation_chars,
            max_observation_tokens: as for every environment. With ``isolation process`` (the default) the
            tools run in the environment's processes: a function tool past ``tool_timeout_s`` is an error
            result, and one that holds its ``step`` past ``timeout_s`` is killed with its process.
    """

    def __init__(self, tools: list[str] | None = None, parser: str = "hermes",
                 tool_prompt: Literal["auto", "template", "system"] = "auto", system_prompt: str = "",
                 examples: str | None = None, tool_timeout_s: float = 10.0, max_result_chars: int = 2000,
                 python_sandbox: Literal["bwrap", "none"] = "bwrap",
                 **options: Any) -> None:  # noqa: ANN401  Environment's arguments, checked there
        super().__init__(**options)
        self.tools = list(tools) if tools is not None else ["calculator"]
        if not self.tools:
            raise ConfigError("--env.tools is empty: name at least one tool (built-in: "
                              f"{', '.join(BUILTIN_TOOLS)}; or pkg.module:function, file.py:function)")
        self.parser, self.tool_prompt, self.system_prompt = parser, tool_prompt, system_prompt
        self.tool_timeout_s, self.max_result_chars = tool_timeout_s, max_result_chars
        self.python_sandbox = python_sandbox
        if python_sandbox not in ("bwrap", "none"):
            raise ConfigError(f"--env.python_sandbox {python_sandbox!r}: valid choices: bwrap, none")
        if "python" in self.tools:
            try:
                check_sandbox(python_sandbox)
            except SandboxUnavailable as err:
                raise ConfigError(f"--env.tools python: {err}") from None
            if python_sandbox == "none":
                log.warning("--env.python_sandbox none: the python tool runs the model's code without isolation; "
                            "it can read and write whatever this process can")
        self._functions = {name: fn for name, fn in (_load_tool(spec, python_sandbox) for spec in self.tools)}
        self._schemas = [tool_schema(fn) for fn in self._functions.values()]
        self._parser = get_parser(parser)
        self.examples = examples
        self._examples = _read_examples(examples) if examples else []
        self._in_template = False
        self._example_messages: list[dict[str, str]] = []

    def __getstate__(self) -> dict[str, Any]:
        """Pickled to the environment's processes without the tool functions (one from a ``file.py`` is no
        importable module's): they are loaded again there from ``tools``."""
        state = super().__getstate__()
        state.pop("_functions", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._functions = {name: fn for name, fn in map(_load_tool, self.tools)}

    def setup(self, tokenizer: Any) -> None:  # noqa: ANN401  a transformers tokenizer
        super().setup(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        if not template or not isinstance(template, str):
            raise ConfigError("--env tools: the tokenizer has no chat template to render the conversation in")
        renders_tools = "tools" in template
        if self.tool_prompt == "template" and not renders_tools:
            raise ConfigError("--env.tool_prompt template: this model's chat template does not render tools; use "
                              "--env.tool_prompt system (or auto)")
        self._in_template = self.tool_prompt == "template" or (self.tool_prompt == "auto" and renders_tools)
        self._render_suffix([])  # the template renders a conversation gcore can append to
        self._example_messages = [m for example in self._examples for m in self._example_turns(*example)]

    # -- the conversation -------------------------------------------------------------------------
    def prompt_ids(self, prompt: Prompt) -> list[int]:
        messages = [{"role": "user", "content": prompt.content if prompt.content is not None else prompt.text}]
        if not self._in_template:
            text = "\n\n".join(t for t in (self.system_prompt, self._parser.tools_prompt(self._schemas)) if t)
            messages.insert(0, {"role": "system", "content": text})
        elif self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        messages[-1:-1] = self._example_messages
        text = self._apply(messages, tools=self._schemas if self._in_template else None, add_generation_prompt=True)
        return list(self._tokenizer().encode(text, add_special_tokens=False))

    def step(self, state: dict[str, Any], response: str) -> Turn:
        try:
            calls = self._parser.parse(response)
        except ToolCallError as err:
            return Turn(observation=self._results([("error", f"malformed tool call: {err}")]),
                        metrics={"tool_calls": 1.0, "tool_errors": 1.0, "tool_errors/malformed": 1.0})
        if not calls:
            return Turn(done=True)
        metrics = {"tool_calls": float(len(calls)), "tool_errors": 0.0}
        results = []
        for call in calls:
            outcome = call_tool(self._functions, call, self.tool_timeout_s, self.max_result_chars)
            content = outcome.content
            if outcome.error is not None:
                metrics["tool_errors"] += 1.0
                metrics[f"tool_errors/{outcome.error}"] = metrics.get(f"tool_errors/{outcome.error}", 0.0) + 1.0
            results.append((call.name, content))
        return Turn(observation=self._results(results), metrics=metrics)

    def _results(self, results: list[tuple[str, str]]) -> str:
        """The tool results as the text that follows the model's end-of-turn token."""
        return self._render_suffix(self._result_messages(results))

    def _result_messages(self, results: list[tuple[str, str]]) -> list[dict[str, str]]:
        """The template's own tool messages, or (system mode) one user message of the parser's result blocks."""
        if self._in_template:
            return [{"role": "tool", "name": name, "content": content} for name, content in results]
        blocks = "\n".join(self._parser.format_result(name, content) for name, content in results)
        return [{"role": "user", "content": blocks}]

    def _example_turns(self, where: str, prompt: str, calls: list[ToolCall], answer: str) -> list[dict[str, str]]:
        """One worked example as conversation turns: the question, the calls, the tools' results, the answer."""
        try:
            written = "\n".join(self._parser.format_call(call) for call in calls)
        except NotImplementedError as err:
            raise ConfigError(f"--env.examples: {err}") from None
        results = []
        for call in calls:
            outcome = call_tool(self._functions, call, self.tool_timeout_s, self.max_result_chars)
            if outcome.error is not None:
                raise ConfigError(f"--env.examples {where}: the call to {call.name!r} fails ({outcome.error}): "
                                  f"{outcome.content}")
            results.append((call.name, outcome.content))
        turns = [{"role": "user", "content": prompt}]
        if calls:
            turns += [{"role": "assistant", "content": written}, *self._result_messages(results)]
        return [*turns, {"role": "assistant", "content": answer}]

    def _render_suffix(self, messages: list[dict[str, str]]) -> str:
        """What the chat template writes after an assistant turn's end-of-turn token for ``messages``, up
        to the next assistant turn's start (the conversation before it is a placeholder). The end-of-turn token
        is the one the model writes to end its turn (``turn_end_ids``: ChatML's ``<|im_end|>``, Gemma's
        ``<end_of_turn>``), or the EOS; a turn cut at the budget gets it from the episode loop."""
        from gcore.envs.episodes import turn_end_ids

        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        before = self._apply(base, add_generation_prompt=False)
        full = self._apply(base + messages, add_generation_prompt=True)
        tokenizer = self._tokenizer()
        closing = str(tokenizer.decode(turn_end_ids(tokenizer)))
        eos = getattr(tokenizer, "eos_token", None) or ""
        end = before.rindex("A") + 1
        for token in (closing, eos):
            if token and before.startswith(token, end):
                end += len(token)
                break
        if full[:end] != before[:end]:
            raise ConfigError("--env tools: the chat template renders an assistant turn differently when more "
                              "messages follow it; gcore cannot append tool results as tokens to it")
        return full[end:]

    def _apply(self, messages: list[dict[str, str]], tools: list[dict] | None = None,
               add_generation_prompt: bool = False) -> str:
        try:
            text = self._tokenizer().apply_chat_template(messages, tools=tools, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
        except Exception as err:  # noqa: BLE001  a template's own error (jinja, a role it refuses), named
            raise ConfigError(f"--env tools: the chat template cannot render the conversation: "
                              f"{type(err).__name__}: {err}") from None
        return str(text)

    def _tokenizer(self) -> Any:  # noqa: ANN401  a transformers tokenizer
        if self.tokenizer is None:
            raise RuntimeError("ToolEnvironment.setup was not called")
        return self.tokenizer


def _load_tool(spec: str, python_sandbox: str = "bwrap") -> tuple[str, Callable[..., Any]]:
    if spec == "python":
        return spec, builtin.python_tool(python_sandbox)
    if spec in BUILTIN_TOOLS:
        return spec, BUILTIN_TOOLS[spec]
    if ":" not in spec:
        raise ConfigError(f"--env.tools {spec!r}: valid built-in tools: {', '.join(BUILTIN_TOOLS)} (or "
                          "pkg.module:function, file.py:function)")
    fn = load_callable(spec, "--env.tools")
    return getattr(fn, "__name__", spec.rpartition(":")[2]), fn


def _read_examples(path: str) -> list[tuple[str, str, list[ToolCall], str]]:
    """``--env.examples``: (where, prompt, calls, answer) for each line of a ``.jsonl`` file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--env.examples {path}: cannot read it ({err})") from None
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--env.examples {where}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("answer"),
                                                                                                   str):
            raise ConfigError(f'--env.examples {where}: each line needs "prompt" and "answer" strings, and '
                              f'optionally "calls": [{{"name": ..., "arguments": {{...}}}}]')
        calls = row.get("calls", [])
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)
                for c in calls):
            raise ConfigError(f'--env.examples {where}: "calls" must be a list of {{"name": str, "arguments": '
                              f'{{...}}}}')
        examples.append((where, row["prompt"], [ToolCall(c["name"], c.get("arguments", {})) for c in calls],
                         row["answer"]))
    if not examples:
        raise ConfigError(f"--env.examples {path}: the file has no examples")
    return examples
