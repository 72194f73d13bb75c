"""A small agent written with the ``openai`` client, trained by gcore as it is (docs/agents.md, "Agents of your own").

It asks the model the prompt with one tool, a calculator it runs itself; when the model calls it, the agent sends
the result back and asks again (at most ``MAX_ROUNDS`` times). It returns its own reward: the share of the
characters of the model's last reply equal to the prompt row's answer (the embedded task's ``target_char``
score: the tiny default model has signal there from its first step). Nothing in it knows about gcore: point
``base_url`` at any OpenAI-compatible server and it runs the same.

    gcore fit --config examples/agents/calc_agent.yaml
"""

import ast
import json
import operator

from openai import OpenAI

MAX_ROUNDS = 3

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                        "description": "e.g. 12*(3+4)"}},
                       "required": ["expression"]},
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The agent's own tool: + - * / on numbers, through ``ast`` (no ``eval``)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as err:
        return f"error: {err}"


def run(base_url: str, task: dict) -> float:
    client = OpenAI(base_url=base_url, api_key="not-needed")
    messages = list(task["messages"])
    reply = ""
    for _ in range(MAX_ROUNDS):
        response = client.chat.completions.create(model=task["model"], messages=messages, tools=[CALCULATOR])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        reply = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = calculator(str(arguments.get("expression", ""))) if call.function.name == "calculator" \
                else f"error: no tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = task["answer"] or ""
    return sum(ch == answer for ch in reply) / max(len(reply), 1) if answer else 0.0
