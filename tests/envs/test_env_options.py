"""Every environment's and rule reward's shared options are their base's, forwarded by keyword: one declaration,
every CLI (as ``tests/algorithms/test_algorithm_options.py`` checks for algorithms)."""

from __future__ import annotations

import inspect

import pytest
from jsonargparse._parameter_resolvers import get_signature_parameters

from gcore.envs.base import Environment
from gcore.envs.reveal import RevealEnvironment
from gcore.envs.tool_env import ToolEnvironment
from gcore.rewards.base import RuleReward
from gcore.rewards.math import MathReward
from gcore.rewards.rule import CallableReward, RegexReward, TargetCharReward

ENV_SHARED = [name for name in inspect.signature(Environment.__init__).parameters if name != "self"]
REWARD_SHARED = [name for name in inspect.signature(RuleReward.__init__).parameters if name != "self"]
#: a value other than every default, for each shared option
VALUES = {"max_turns": 3, "max_tokens": 50, "workers": 2, "timeout_s": 7.0, "overlap": False, "isolation": "thread",
          "max_observation_chars": 99, "max_observation_tokens": 33, "on_error": "zero", "timeout": 4.0}
#: what each class needs besides the shared options
REQUIRED = {RegexReward: {"pattern": "x"}, CallableReward: {"function": "operator:add"}}
FAMILIES = [(RevealEnvironment, ENV_SHARED), (ToolEnvironment, ENV_SHARED), (TargetCharReward, REWARD_SHARED),
            (RegexReward, REWARD_SHARED), (CallableReward, REWARD_SHARED), (MathReward, REWARD_SHARED)]
IDS = [cls.__name__ for cls, _ in FAMILIES]


def test_every_shared_option_has_a_value_to_try():
    assert set(VALUES) == set(ENV_SHARED) | set(REWARD_SHARED)


@pytest.mark.parametrize(("cls", "shared"), FAMILIES, ids=IDS)
def test_every_shared_option_reaches_the_cli_and_the_instance(cls, shared):
    if cls is MathReward:
        pytest.importorskip("math_verify")
    # the CLI's flags are what jsonargparse resolves from the signatures, following ``**options``
    params = {p.name: p for p in get_signature_parameters(cls)}
    assert set(shared) <= set(params), f"{cls.__name__} lacks {set(shared) - set(params)}"
    default = cls(**REQUIRED.get(cls, {}))
    for name in shared:  # the CLI's default is the one the instance gets
        assert getattr(default, name) == params[name].default, (cls.__name__, name)
    given = cls(**REQUIRED.get(cls, {}), **{name: VALUES[name] for name in shared})
    for name in shared:  # forwarded by keyword, to the option of that name
        assert getattr(given, name) == VALUES[name], (cls.__name__, name)


def _base_init_with_a_new_option(base: type) -> object:
    """``base.__init__`` with one more option, ``new_option``, forwarding the others by keyword."""
    original = base.__init__

    def __init__(self, new_option: int = 7, **options):
        original(self, **options)
        self.new_option = new_option

    __init__.__doc__ = None
    return __init__


@pytest.mark.parametrize(("cls", "shared"), FAMILIES, ids=IDS)
def test_an_option_added_to_the_base_reaches_every_subclass(cls, shared, monkeypatch):
    # before: each subclass re-declared the base's options and passed them on by position, so an option added
    # to the base was missing from every subclass's CLI until each was edited
    if cls is MathReward:
        pytest.importorskip("math_verify")
    base = Environment if shared is ENV_SHARED else RuleReward
    monkeypatch.setattr(base, "__init__", _base_init_with_a_new_option(base))
    params = {p.name: p for p in get_signature_parameters(cls)}
    assert "new_option" in params and params["new_option"].default == 7, sorted(params)
    assert cls(**REQUIRED.get(cls, {}), new_option=3).new_option == 3
