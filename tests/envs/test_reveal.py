"""The embedded multi-turn task's environment (``--env reveal``): what the model sees, and its control."""

from gcore import Prompt
from gcore.envs.reveal import RevealEnvironment
from gcore.model import char_tokenizer


def _env(**options):
    env = RevealEnvironment(**options)
    env.setup(char_tokenizer())
    return env


def _prompt(text: str, answer: str) -> Prompt:
    return Prompt(0, text, char_tokenizer()(text)["input_ids"], answer)


def test_the_prompt_never_shows_the_digit_whatever_the_task():
    """``gcore fit --env reveal`` alone runs on the default task, whose prompt is the digit itself (``7=``): the
    environment hides it, so the model starts from ``?=`` as on the embedded ``reveal`` task."""
    env, tokenizer = _env(), char_tokenizer()
    hidden = tokenizer("?=")["input_ids"]
    assert env.prompt_ids(_prompt("7=", "7")) == hidden
    assert env.prompt_ids(_prompt("?=", "7")) == hidden
    assert tokenizer.decode(env.prompt_ids(_prompt("7+7=", "7"))) == tokenizer.decode(tokenizer("?+?=")["input_ids"])


def test_the_observation_reveals_the_digit_and_the_control_does_not():
    shown, control = _env(repeat=3), _env(repeat=3, show=False)
    for env, observation in ((shown, "|777="), (control, "|???=")):
        state = env.reset(_prompt("7=", "7"))
        assert env.step(state, "x").observation == observation
        assert env.step(state, "y").done
