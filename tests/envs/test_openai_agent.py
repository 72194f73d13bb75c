"""``--env openai_agent``: an agent written with the ``openai`` client drives the policy through gcore's endpoint;
the requests are batched into the engine's ``generate`` and the trajectory is the engine's own ids."""

import csv
import json
import textwrap
from pathlib import Path

import pytest
from conftest import Recording, tiny_hf_engine

from gcore import Prompt, SamplingParams
from gcore.envs.episodes import EpisodeStats, run_episodes
from gcore.envs.openai_agent import CHATML, OpenAIAgentEnvironment
from gcore.errors import ConfigError
from gcore.model import char_tokenizer
from gcore.types import Generation

pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer, path, engine = tiny_hf_engine(tmp_path_factory.mktemp("model"))
    return tokenizer, engine


def _agent(tmp_path, body: str) -> str:
    """``agent.py:run`` in ``tmp_path``, ``run(base_url, task)`` with ``body`` (an OpenAI client ``client``)."""
    code = "import json, time\nfrom openai import OpenAI\n\ndef run(base_url, task):\n" \
           "    client = OpenAI(base_url=base_url, api_key='x', max_retries=0)\n" + textwrap.indent(body, "    ")
    path = tmp_path / "agent.py"
    path.write_text(code)
    return f"{path}:run"


def _env(tmp_path, body, template=CHATML, **kw):
    kw.setdefault("isolation", "thread")
    env = OpenAIAgentEnvironment(entry=_agent(tmp_path, body), chat_template=template, batch_wait_s=60.0, **kw)
    return env


def _prompts(tokenizer, k=2):
    return [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"], str(i)) for i in range(k)]


def _params(tokenizer, tokens=6):
    return SamplingParams(n=2, max_new_tokens=tokens, stop_token_ids=(tokenizer.eos_token_id,))


TWO_REQUESTS = """
assert [m.id for m in client.models.list().data] == ["gcore-policy"]
messages = list(task["messages"])
first = client.chat.completions.create(model="gpt-4o", messages=messages)
messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
second = client.chat.completions.create(model="gpt-4o", messages=messages)
assert second.model == "gpt-4o" and second.usage.completion_tokens >= 1
return 0.5
"""


def test_the_openai_client_drives_the_policy_and_the_trajectory_is_the_engines_ids(tiny, tmp_path):
    """Two requests per episode from the real client, 4 episodes: each round is one batched ``generate``;
    the sample is request 1's prompt, then reply 1, the new message's ids, reply 2, exactly as the engine
    got and gave them (ids, log-probabilities), the replies masked 1, the message 0."""
    tokenizer, engine = tiny
    record = tmp_path / "requests.jsonl"
    env = _env(tmp_path, TWO_REQUESTS, record=str(record))
    env.setup(tokenizer)
    generate, stats = Recording(engine), EpisodeStats()
    samples = run_episodes(env, generate, _prompts(tokenizer), _params(tokenizer), tokenizer, stats=stats)
    assert stats.first_error is None, stats.first_error
    assert len(generate.calls) == 2 and [len(prompts) for prompts, _ in generate.calls] == [4, 4]  # batched
    assert stats.counts["requests"] == 8 and stats.counts["prefix_breaks"] == 0
    first_prompts, first_outputs = generate.calls[0]
    second_prompts, second_outputs = generate.calls[1]
    for sample in samples:
        assert sample.finished and sample.turns == 2 and sample.env_reward == 0.5
        (reply1,) = [o[0] for p, o in zip(first_prompts, first_outputs, strict=True)  # (n=2: the same prompt twice)
                     if p == sample.prompt.token_ids and sample.response_ids[:len(o[0].token_ids)] == o[0].token_ids]
        whole = sample.prompt.token_ids + sample.response_ids
        (j,) = [j for j, p in enumerate(second_prompts) if whole[:len(p)] == p]
        reply2 = second_outputs[j][0]
        gap = second_prompts[j][len(sample.prompt.token_ids) + len(reply1.token_ids):]
        assert tokenizer.decode(gap) == "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
        assert sample.response_ids == reply1.token_ids + gap + reply2.token_ids
        assert sample.response_logprobs == reply1.logprobs + [0.0] * len(gap) + reply2.logprobs
        assert sample.response_mask == [1] * len(reply1.token_ids) + [0] * len(gap) + [1] * len(reply2.token_ids)
        assert sample.response_text == tokenizer.decode(reply2.token_ids, skip_special_tokens=True)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(r["prompt_ids"] for r in lines) == sorted(first_prompts + second_prompts)
    assert sorted(r["completion_ids"] for r in lines) == sorted(o[0].token_ids for o in first_outputs + second_outputs)
    assert sum(r["new_chain"] for r in lines) == 4


EDITS_HISTORY = """
messages = list(task["messages"])
first = client.chat.completions.create(model="m", messages=messages)
# the agent rewrites the model's reply (a summary, a cleaned-up answer): the conversation no longer extends it
messages += [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "go on"}]
second = client.chat.completions.create(model="m", messages=messages)
messages += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "end"}]
client.chat.completions.create(model="m", messages=messages)
"""


def test_an_edited_history_starts_a_new_chain_and_the_episode_keeps_the_last(tiny, tmp_path):
    tokenizer, engine = tiny
    env = _env(tmp_path, EDITS_HISTORY)
    env.setup(tokenizer)
    generate, stats = Recording(engine), EpisodeStats()
    samples = run_episodes(env, generate, _prompts(tokenizer, 1), _params(tokenizer), tokenizer, stats=stats)
    assert stats.counts["prefix_breaks"] == 2 and stats.counts["dropped_tokens"] > 0  # one per episode
    second_prompts = generate.calls[1][0]
    for sample in samples:
        assert sample.turns == 2 and sample.finished
        # the new chain starts from a fresh rendering of the edited conversation: "edited" is context, not trained
        assert sample.prompt.token_ids in second_prompts
        text = tokenizer.decode(sample.prompt.token_ids)
        assert text.endswith("<|im_start|>assistant\nedited<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n"
                             "<|im_start|>assistant\n")
        assert sum(sample.response_mask) == len(sample.response_ids) - len(
            tokenizer.encode("<|im_end|>\n<|im_start|>user\nend<|im_end|>\n<|im_start|>assistant\n"))


class Scripted:
    """An engine's ``generate`` that answers with the given texts in turn (the tiny random model does not write
    tool calls), ending each on the end-of-sequence token as a model that stops does."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    def __call__(self, prompts, params):
        outputs = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            outputs.append([Generation(ids, [-0.5] * len(ids), finished=True)])
        return outputs


USES_THE_TOOL = """
tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
messages = list(task["messages"])
seen = []
for _ in range(3):
    reply = client.chat.completions.create(model="m", messages=messages, tools=tools)
    message = reply.choices[0].message
    seen.append([reply.choices[0].finish_reason, message.content,
                 [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]])
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
open(task["metadata"]["out"], "w").write(json.dumps(seen))
"""

#: a ChatML template whose turns end with the tokenizer's end-of-sequence token, as SmolLM2's end with <|im_end|>
ENDS_WITH_EOS = CHATML.replace("<|im_end|>", "</s>")


def test_tool_calls_are_read_into_tool_calls_and_a_malformed_one_stays_text(tiny, tmp_path):
    tokenizer, _ = tiny
    out = tmp_path / "seen.json"
    env = _env(tmp_path, USES_THE_TOOL, template=ENDS_WITH_EOS)
    env.setup(tokenizer)
    generate = Scripted(tokenizer, ['Let me. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
                                    '</tool_call>', "<tool_call>{not json</tool_call>"])
    stats = EpisodeStats()
    prompt = Prompt(0, "2+3=", tokenizer("2+3=")["input_ids"], "5", metadata={"out": str(out)})
    (sample,) = run_episodes(env, generate, [prompt], SamplingParams(n=1, max_new_tokens=80), tokenizer, stats=stats)
    assert stats.first_error is None, stats.first_error
    seen = json.loads(out.read_text())
    assert seen[0] == ["tool_calls", "Let me.", [["calculator", {"expression": "2+3"}]]]
    assert seen[1] == ["stop", "<tool_call>{not json</tool_call>", []]  # malformed: plain content
    assert stats.counts["tool_calls"] == 1 and stats.counts["tool_errors/malformed"] == 1
    # the second request extends the first: the tool result follows the model's own </s>, not a second one
    first_reply = sample.response_ids[:sample.response_mask.index(0)]
    gap = generate.prompts[1][len(generate.prompts[0]) + len(first_reply):]
    assert tokenizer.decode(gap) == "\n<|im_start|>tool\n5</s>\n<|im_start|>assistant\n"
    assert sample.turns == 2 and sample.prompt.token_ids == generate.prompts[0]
    tools_prompt = tokenizer.decode(generate.prompts[0])
    assert tools_prompt.startswith("<|im_start|>system\n") and '"name": "calculator"' in tools_prompt


PAST_THE_LIMITS = """
import openai
refused = []
try:
    client.chat.completions.create(model="m", messages=task["messages"], stream=True)
except openai.BadRequestError as err:
    refused.append(err.message)
messages = list(task["messages"])
for _ in range(4):  # one more than --env.max_turns allows
    try:
        reply = client.chat.completions.create(model="m", messages=messages)
    except openai.BadRequestError as err:
        refused.append(err.message)
        break
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
open(task["metadata"]["out"], "w").write(json.dumps(refused))
return 1.0
"""


def test_stream_is_refused_in_one_line_and_a_request_past_max_turns_truncates_the_episode(tiny, tmp_path):
    tokenizer, _ = tiny
    out = tmp_path / "refused.json"
    env = _env(tmp_path, PAST_THE_LIMITS, max_turns=3)
    env.setup(tokenizer)
    stats = EpisodeStats()
    generate = Scripted(tokenizer, ["a", "b", "c"])
    prompt = Prompt(0, "1=", tokenizer("1=")["input_ids"], "1", metadata={"out": str(out)})
    (sample,) = run_episodes(env, generate, [prompt], SamplingParams(n=1, max_new_tokens=8), tokenizer, stats=stats)
    stream, limit = json.loads(out.read_text())
    assert "stream is not supported" in stream and "--env.max_turns" in limit
    assert sample.turns == 3 and not sample.finished and sample.env_reward == 1.0  # truncated, its reward kept
    assert stats.counts["truncated"] == 1 and "errors" not in stats.counts and len(generate.prompts) == 3


FAILS = """
if task["index"] == 0:
    raise RuntimeError("agent crashed")
if task["index"] == 1 and task["metadata"].get("hang"):
    time.sleep(120)
client.chat.completions.create(model="m", messages=task["messages"])
return 1.0
"""


# the agents' own processes: their forkserver's start is most of the case's time (about 30 s on a busy 2-core VM)
@pytest.mark.parametrize("isolation", ["thread", pytest.param("process", marks=pytest.mark.integration)])
def test_an_agent_that_raises_or_hangs_ends_its_episode_as_an_error_and_the_rollout_goes_on(tiny, tmp_path,
                                                                                           isolation):
    """An agent that raises ends its episode as an error (counted), in threads and in the agents' own processes
    (the default); one that hangs (in a thread here: a process's is killed the same way as any environment
    call's, tests/envs/test_env_safety.py) is abandoned at --env.timeout_s. The other episodes are trained."""
    tokenizer, engine = tiny
    threads = isolation == "thread"
    env = _env(tmp_path, FAILS, isolation=isolation, timeout_s=3.0 if threads else 120.0)
    env.setup(tokenizer)
    stats = EpisodeStats()
    prompts = _prompts(tokenizer, 3)
    prompts[1].metadata["hang"] = threads
    samples = run_episodes(env, engine.generate, prompts, SamplingParams(n=1, max_new_tokens=4), tokenizer,
                           stats=stats)
    assert stats.counts["errors"] == 1 + threads and stats.counts.get("timeouts", 0) == threads
    assert "RuntimeError: agent crashed" in stats.first_error or "did not return" in stats.first_error
    crashed, second, fine = samples
    assert not crashed.finished and crashed.turns == 1 and crashed.response_ids  # a reply to the prompt, as a
    assert second.finished != threads  # reset that failed gets one
    assert fine.finished and fine.env_reward == 1.0 and fine.response_ids


def test_a_bad_entry_or_template_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--env.entry"):
        OpenAIAgentEnvironment(entry="no_colon")
    with pytest.raises(ConfigError, match="does not exist"):
        OpenAIAgentEnvironment(entry=f"{tmp_path}/missing.py:run")
    env = OpenAIAgentEnvironment(entry=_agent(tmp_path, "return 0"))
    with pytest.raises(ConfigError, match="--env.chat_template chatml"):
        env.setup(char_tokenizer())


@pytest.mark.integration
def test_the_example_agent_trains_from_the_command_line(gcore_cli, tmp_path):
    """examples/agents/calc_agent.py, unchanged, in a 2-step ``gcore fit``: its requests are trained on."""
    result = gcore_cli("--env", "gcore.envs.openai_agent.OpenAIAgentEnvironment",
                       "--env.entry", str(ROOT / "examples/agents/calc_agent.py") + ":run",
                       "--env.chat_template", "chatml", "--env.isolation", "thread", "--env.max_turns", "2",
                       "--reward", "none", "--trainer.logger", "csv")
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = (tmp_path / "runs").glob("**/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("samples/trained")]
    assert len(rows) == 2
    assert all(float(r["env/requests"]) >= 8 for r in rows)  # 4 prompts x 2 episodes, each at least one request
    assert all(float(r["samples/trained"]) > 0 for r in rows)
