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

from collections.abc import Callable
from typing import Any, Literal

from gcore.envs import tools as builtin
from gcore.envs.base import Environment, Turn
from gcore.envs.tools import ToolCallError, call_tool, get_parser, tool_schema
from gcore.errors import ConfigError
from gcore.registry import load_callable
from gcore.types import Prompt

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
        tool_timeout_s: a call that does not return in this time is an error result.
        max_result_chars: a tool's result is cut to this many characters.
        max_turns, max_tokens, workers, timeout_s, overlap: as for every environment.
    """

    def __init__(self, tools: list[str] | None = None, parser: str = "hermes",
                 tool_prompt: Literal["auto", "template", "system"] = "auto", system_prompt: str = "",
                 tool_timeout_s: float = 10.0, max_result_chars: int = 2000, max_turns: int = 4,
                 max_tokens: int = 0, workers: int = 16, timeout_s: float = 120.0, overlap: bool = True) -> None:
        super().__init__(max_turns, max_tokens, workers, timeout_s, overlap)
        self.tools = list(tools) if tools is not None else ["calculator"]
        if not self.tools:
            raise ConfigError("--env.tools is empty: name at least one tool (built-in: "
                              f"{', '.join(BUILTIN_TOOLS)}; or pkg.module:function, file.py:function)")
        self.parser, self.tool_prompt, self.system_prompt = parser, tool_prompt, system_prompt
        self.tool_timeout_s, self.max_result_chars = tool_timeout_s, max_result_chars
        self._functions = {name: fn for name, fn in map(_load_tool, self.tools)}
        self._schemas = [tool_schema(fn) for fn in self._functions.values()]
        self._parser = get_parser(parser)
        self._in_template = False

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

    # -- the conversation -------------------------------------------------------------------------
    def prompt_ids(self, prompt: Prompt) -> list[int]:
        messages = [{"role": "user", "content": prompt.content if prompt.content is not None else prompt.text}]
        if not self._in_template:
            text = "\n\n".join(t for t in (self.system_prompt, self._parser.tools_prompt(self._schemas)) if t)
            messages.insert(0, {"role": "system", "content": text})
        elif self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
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
        """The tool results as the text that follows the model's end-of-turn token: the template's own
        tool messages, or (system mode) one user message of the parser's result blocks."""
        if self._in_template:
            messages = [{"role": "tool", "name": name, "content": content} for name, content in results]
        else:
            blocks = "\n".join(self._parser.format_result(name, content) for name, content in results)
            messages = [{"role": "user", "content": blocks}]
        return self._render_suffix(messages)

    def _render_suffix(self, messages: list[dict[str, str]]) -> str:
        """What the chat template writes after an assistant turn's end-of-turn token for ``messages``, up
        to the next assistant turn's start (the conversation before it is a placeholder)."""
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        before = self._apply(base, add_generation_prompt=False)
        full = self._apply(base + messages, add_generation_prompt=True)
        eos = getattr(self._tokenizer(), "eos_token", None) or ""
        end = before.rindex("A") + 1
        if eos and before.startswith(eos, end):
            end += len(eos)
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


def _load_tool(spec: str) -> tuple[str, Callable[..., Any]]:
    if spec in BUILTIN_TOOLS:
        return spec, BUILTIN_TOOLS[spec]
    if ":" not in spec:
        raise ConfigError(f"--env.tools {spec!r}: valid built-in tools: {', '.join(BUILTIN_TOOLS)} (or "
                          "pkg.module:function, file.py:function)")
    fn = load_callable(spec, "--env.tools")
    return getattr(fn, "__name__", spec.rpartition(":")[2]), fn
