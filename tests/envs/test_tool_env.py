"""The ``tools`` environment: the conversation it renders, tool calls and their errors as observations."""

import json

import pytest

from gcore.envs.tool_env import ToolEnvironment
from gcore.errors import ConfigError
from gcore.model import char_tokenizer
from gcore.types import Prompt

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a template that renders tools= itself (as Qwen2.5's does)
WITH_TOOLS = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
              "<|im_end|>\n{% endif %}" + CHATML)


def _tokenizer(template=CHATML):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def _env(template=CHATML, **kw):
    env = ToolEnvironment(**kw)
    env.setup(_tokenizer(template))
    return env


def _call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


@pytest.mark.usefixtures("needs_bwrap")
def test_the_prompt_describes_the_tools_in_a_system_message_when_the_template_cannot():
    env = _env(tools=["calculator", "python"])
    prompt = Prompt(0, "rendered", [1], "5", content="What is 2+3?")
    text = env.tokenizer.decode(env.prompt_ids(prompt))
    assert text.startswith("<|im_start|>system\n") and '"name": "calculator"' in text and '"name": "python"' in text
    assert "<tool_call>" in text  # the call format
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_renders_tools_gets_them_as_tools():
    env = _env(WITH_TOOLS, tools=["calculator"])
    text = env.tokenizer.decode(env.prompt_ids(Prompt(0, "q", [1], content="q")))
    assert text.startswith("<|im_start|>system\nTOOLS: calculator<|im_end|>")
    with pytest.raises(ConfigError, match="does not render tools"):
        _env(CHATML, tool_prompt="template")


def test_a_call_gets_its_result_and_an_answer_ends_the_episode():
    env = _env()
    turn = env.step({}, "Let me compute. " + _call("calculator", expression="12*(3+4)"))
    assert not turn.done and turn.metrics["tool_calls"] == 1 and turn.metrics["tool_errors"] == 0
    # what follows the model's end of turn, up to the next assistant turn: a user message with the result
    assert turn.observation == "<|im_end|>\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n" \
                               "<|im_start|>assistant\n"
    assert env.step({}, "The answer is 84.").done


@pytest.mark.parametrize("response, kind, shown", [
    ("<tool_call>{not json</tool_call>", "malformed", "malformed tool call"),
    (_call("search", query="x"), "unknown_tool", "calculator"),  # the valid tools are named
    (_call("calculator", expr="1"), "bad_arguments", "expr"),
    (_call("calculator", expression="1/0"), "raised", "ZeroDivisionError"),
])
def test_a_bad_call_is_an_error_the_model_sees(response, kind, shown):
    turn = _env().step({}, response)
    assert not turn.done and turn.metrics["tool_errors"] == 1 and turn.metrics[f"tool_errors/{kind}"] == 1
    assert shown in turn.observation


@pytest.mark.usefixtures("needs_bwrap")
def test_python_tool_runs_sandboxed_code():
    turn = _env(tools=["python"]).step({}, _call("python", code="print(sum(range(10)))"))
    assert "<tool_response>\n45\n" in turn.observation and turn.metrics["tool_errors"] == 0
    looping = _env(tools=["python"]).step({}, _call("python", code="while True: pass"))
    # ended by its CPU-time limit (5 s of CPU), or, on a machine too busy to give it those within the tool's 10 s of
    # wall-clock time, by that (a fresh clone's suite beside other work got the second): an error either way
    assert looping.metrics["tool_errors"] == 1
    assert "CPU limit" in looping.observation or "did not finish within" in looping.observation, looping.observation


def test_own_tools_and_bad_tool_specs(tmp_path):
    module = tmp_path / "my_tools.py"
    module.write_text('def shout(text: str) -> str:\n    """Upper-case text.\n\n    Args:\n        text: the text\n'
                      '    """\n    return text.upper()\n\n\ndef untyped(x):\n    return x\n')
    env = _env(tools=[f"{module}:shout"])
    assert "HEY" in env.step({}, _call("shout", text="hey")).observation
    with pytest.raises(ConfigError, match="valid built-in tools: calculator, python"):
        ToolEnvironment(tools=["nonsense"])
    with pytest.raises(ConfigError, match="untyped") as err:
        ToolEnvironment(tools=[f"{module}:untyped"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no chat template"):
        ToolEnvironment().setup(char_tokenizer())


def test_worked_examples_come_before_the_question_with_the_tools_own_results(tmp_path):
    """``--env.examples``: each example is a user turn, the call in the parser's format, the result the tool
    itself returned, and the answer, all before the question; the written call parses back to the same call."""
    examples = tmp_path / "examples.jsonl"
    examples.write_text(json.dumps({"prompt": "What is 6 times 7?", "answer": "The answer is 42.",
                                    "calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}) + "\n\n"
                        + json.dumps({"prompt": "Say hi.", "answer": "hi"}) + "\n")
    env = _env(examples=str(examples))
    text = env.tokenizer.decode(env.prompt_ids(Prompt(0, "q", [1], content="What is 2+3?")))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    assert ("<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n" + call + "<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n"
            "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n"
            "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n") in text
    assert env._parser.parse(call)[0].arguments == {"expression": "6*7"}


@pytest.mark.parametrize("line, message", [
    ("{not json", r"examples.jsonl:1: not JSON"),
    ('{"prompt": "q"}', r'examples.jsonl:1: each line needs "prompt" and "answer"'),
    ('{"prompt": "q", "answer": "a", "calls": [{"name": 3}]}', r'examples.jsonl:1: "calls" must be a list'),
    ('{"prompt": "q", "answer": "a", "calls": [{"name": "calculator", "arguments": {"expression": "1/0"}}]}',
     r"examples.jsonl:1: the call to 'calculator' fails \(raised\)"),
    ("", r"the file has no examples"),
])
def test_bad_examples_are_one_line_naming_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "examples.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        _env(examples=str(path))


def test_the_tools_environment_runs_in_its_own_process_with_tools_from_a_file(tmp_path):
    """``--env.isolation process`` pickles the environment to a child: a tool loaded from a ``file.py`` (no
    importable module) is loaded again there, and its result comes back."""
    import os

    from gcore.envs.isolation import ProcessRunner

    module = tmp_path / "my_tools.py"
    module.write_text('import os\n\n\ndef pid(text: str) -> str:\n    """The process that runs the tool.\n\n'
                      '    Args:\n        text: anything\n    """\n    return f"{text} {os.getpid()}"\n')
    env = _env(tools=[f"{module}:pid"])
    runner = ProcessRunner(env)
    try:
        turn, state = runner.call("step", ({"k": 1}, _call("pid", text="ran in")), 120.0)
    finally:
        runner.close()
    assert state == {"k": 1} and turn.metrics["tool_errors"] == 0
    ran_in = int(turn.observation.split("ran in ")[1].split()[0])
    assert ran_in != os.getpid() and runner.started == 1
