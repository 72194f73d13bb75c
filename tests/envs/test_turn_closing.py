"""A turn cut at the token budget is closed the way the chat template closes a turn, as context, before its
observation (``gcore.envs.episodes.turn_end_ids``)."""

import pytest
import torch
from conftest import Recording, Scripted, tiny_hf_engine

from gcore import Prompt, SamplingParams
from gcore.envs.episodes import run_episodes, turn_end_ids
from gcore.model import char_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer, path, engine = tiny_hf_engine(tmp_path_factory.mktemp("model"))
    return tokenizer, engine


def test_a_cut_turn_gets_the_eos_before_its_observation_as_context(tiny):
    """The tiny default model has no chat template: its EOS closes a cut turn; mask 0, log-probability 0; a turn
    the model ended itself (its EOS generated) gets nothing more."""
    tokenizer, engine = tiny
    assert turn_end_ids(tokenizer) == [tokenizer.eos_token_id]
    generate = Recording(engine)
    params = SamplingParams(n=2, max_new_tokens=3, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    prompts = [Prompt(i, f"{i}=", tokenizer(f"{i}=")["input_ids"], str(i)) for i in range(2)]
    torch.manual_seed(0)
    samples = run_episodes(Scripted(turns=3, isolation="thread"), generate, prompts, params, tokenizer)
    closed = 0
    for sample in samples:
        at = 0
        for turn in range(1, 4):
            context = sample.prompt.token_ids + sample.response_ids[:at]
            call = next(c for c in generate.calls if context in c[0])
            generation = next(g for g in call[1][call[0].index(context)]
                              if sample.response_ids[at : at + len(g.token_ids)] == g.token_ids)
            at += len(generation.token_ids)
            assert sample.response_mask[at - len(generation.token_ids) : at] == [1] * len(generation.token_ids)
            if turn == 3:
                break
            observation = tokenizer.encode(f"|{turn}|", add_special_tokens=False)
            closing = [] if generation.finished else [tokenizer.eos_token_id]
            closed += len(closing)
            following = closing + observation
            assert sample.response_ids[at : at + len(following)] == following
            assert sample.response_mask[at : at + len(following)] == [0] * len(following)
            assert sample.response_logprobs[at : at + len(following)] == [0.0] * len(following)
            at += len(following)
        assert at == len(sample.response_ids)
    assert closed > 0  # turns were cut at the budget of 3 tokens, and closed


def _with_template(template: str | None, specials: list[str]):
    tokenizer = char_tokenizer()
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = template
    return tokenizer


def test_the_closing_tokens_come_from_the_chat_template():
    chatml = _with_template(CHATML, ["<|im_start|>", "<|im_end|>"])
    assert turn_end_ids(chatml) == chatml.convert_tokens_to_ids(["<|im_end|>"])  # not the newline after it
    gemma = _with_template(GEMMA, ["<start_of_turn>", "<end_of_turn>"])
    assert turn_end_ids(gemma) == gemma.convert_tokens_to_ids(["<end_of_turn>"])
    assert turn_end_ids(gemma) != [gemma.eos_token_id]
    plain = _with_template("{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}", [])
    assert turn_end_ids(plain) == [plain.eos_token_id]  # no special token after the content: the EOS
    refusing = _with_template("{{ raise_exception('no assistant turns here') }}", [])
    assert turn_end_ids(refusing) == [refusing.eos_token_id]


def test_tool_results_follow_the_templates_end_of_turn_token():
    """``--env tools`` renders its observations after the token that closes a turn: for a Gemma-style template,
    whose EOS is not its end-of-turn token, ``<end_of_turn>`` is not written a second time."""
    from gcore.envs.tool_env import ToolEnvironment

    gemma = _with_template(GEMMA, ["<start_of_turn>", "<end_of_turn>"])
    env = ToolEnvironment(tools=["calculator"], tool_prompt="system", isolation="thread")
    env.setup(gemma)
    suffix = env._results([("calculator", "4")])
    assert suffix.startswith("\n<start_of_turn>user\n") and suffix.endswith("<start_of_turn>model\n")
    assert "<end_of_turn>" not in suffix.split("<start_of_turn>user")[0]
