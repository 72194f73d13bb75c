"""Every algorithm's shared options are ``Algorithm``'s, forwarded by keyword: one declaration, every CLI."""

import inspect

import pytest
from jsonargparse._parameter_resolvers import get_signature_parameters

from gcore.algorithms.base import Algorithm
from gcore.algorithms.dapo import DAPO
from gcore.algorithms.grpo import GRPO
from gcore.algorithms.ppo import PPO
from gcore.algorithms.rloo import RLOO

SHARED = [name for name in inspect.signature(Algorithm.__init__).parameters if name != "self"]
#: the shared options an algorithm fixes instead of taking (RLOO has never had an entropy bonus flag)
FIXED = {RLOO: {"entropy_coef"}}
#: a value other than every default, for each shared option
VALUES = {"kl_coef": 0.5, "kl_estimator": "k2", "loss_agg": "seq_mean_token_sum_norm", "epochs": 3,
          "mini_batches": 4, "entropy_coef": 0.01, "behaviour_is_cap": 5.0, "mismatch_correction": "token_mask",
          "mismatch_low": 0.5, "mismatch_high": 3.0}


def test_the_shared_options_are_keyword_only():
    assert set(VALUES) == set(SHARED)
    kinds = {p.kind for name, p in inspect.signature(Algorithm.__init__).parameters.items() if name != "self"}
    assert kinds == {inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize("cls", [GRPO, DAPO, RLOO, PPO])
def test_every_shared_option_reaches_the_cli_and_the_instance(cls):
    # the CLI's flags are what jsonargparse resolves from the signatures, following ``**options``
    params = {p.name: p for p in get_signature_parameters(cls)}
    taken = [name for name in SHARED if name not in FIXED.get(cls, set())]
    assert set(taken) <= set(params), f"{cls.__name__} lacks {set(taken) - set(params)}"
    assert not FIXED.get(cls, set()) & set(params)
    default = cls()
    for name in taken:  # the CLI's default is the one the instance gets
        assert getattr(default, name) == params[name].default, (cls.__name__, name)
    given = cls(**{name: VALUES[name] for name in taken})
    for name in taken:  # forwarded by keyword, not by position
        assert getattr(given, name) == VALUES[name], (cls.__name__, name)


@pytest.mark.parametrize("name", ["grpo", "dapo", "rloo", "ppo"])
def test_clip_ratio_c_from_the_command_line(name):
    from gcore import cli

    parser = cli.build_fit_parser()
    argv = cli.resolve_argv(["--algorithm", name, "--algorithm.clip_ratio_c", "3"])
    config = parser.parse_args(cli.with_default_plugins(argv))
    assert parser.instantiate_classes(config)["algorithm"].clip_ratio_c == 3.0


def test_a_bad_clip_ratio_c_is_one_line_naming_the_flag():
    from gcore import cli
    from gcore.errors import ConfigError

    with pytest.raises(ConfigError) as caught:  # raised before anything is built or trained
        cli.fit_main(["--algorithm", "ppo", "--algorithm.clip_ratio_c", "1"])
    assert str(caught.value) == "--algorithm.clip_ratio_c must be > 1, got 1.0"
