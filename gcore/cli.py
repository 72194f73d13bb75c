"""``gcore`` command line: ``gcore fit ...`` trains, ``gcore plugins`` lists what is installed.

Built on jsonargparse, as LightningCLI is: ``--config cfg.yaml``, ``--print_config``, dotted
overrides (``--algorithm.clip_eps 0.3``), and any class path for a plugin. Plugins may also be
named by their entry-point name (``--algorithm grpo``); names are resolved here, through the
registry, before jsonargparse sees them.
"""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from gcore import registry
from gcore.config_errors import check_config_file, config_paths, last_set, placed, typed, unknown_option
from gcore.errors import ConfigError, GcoreError

#: the default plugin of each family
DEFAULTS = {"engine": "hf", "reward": "target_char", "algorithm": "grpo", "placement": "static", "backend": "torch",
            "env": "single_turn"}

USAGE = """usage: gcore <command> [options]

commands:
  fit       train a policy with RL (gcore fit --help)
  plugins   list the installed engines, rewards, algorithms, placement policies and backends
  report    plot a run's metrics to PNG files and one HTML page, and summarise it (gcore report RUN_DIR)
  samples   a step's best, median and worst traced samples (gcore samples RUN_DIR [--step K])
  export    write a checkpoint's policy as an HF checkpoint (gcore export CKPT --to hf DIR)
  import    convert a GGUF model file to an HF checkpoint once (gcore import FILE.gguf DIR)
  eval      a model's accuracy on a held-out prompt set (gcore eval --help)
  simulate  compare static and dynamic placement on a simulated cluster (gcore simulate --help)

`gcore fit` with no options trains the embedded tiny model on the embedded task, on CPU.
"""


def _resolve_value(family: str, value: object) -> object:
    """Replace a plugin name with its class path, in ``name`` or ``{class_path: name}`` form."""
    if isinstance(value, str) and "." not in value and not value.startswith(("{", "[")):
        return registry.resolve(family, value)
    if isinstance(value, dict) and isinstance(value.get("class_path"), str):
        return {**value, "class_path": registry.resolve(family, value["class_path"])}
    return value


#: options of a plugin that take another family's plugin by name (``--algorithm.teacher_engine hf``)
NESTED_PLUGINS = {"--algorithm.teacher_engine": "engine"}


def resolve_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite ``--family NAME``/``--family=NAME``/``--family.help NAME`` (and ``NESTED_PLUGINS``'s) to class paths."""
    out, args = [], list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        for family in (*registry.GROUPS, *NESTED_PLUGINS):
            flags: tuple[str, ...]
            if family in NESTED_PLUGINS:
                flags, family = (family,), NESTED_PLUGINS[family]
            else:
                flags = (f"--{family}", f"--{family}.help", f"--{family}.class_path")
            for flag in flags:
                if arg == flag and i + 1 < len(args) and not args[i + 1].startswith("-"):
                    out.extend([arg, str(_resolve_value(family, args[i + 1]))])
                    i += 2
                    break
                if arg.startswith(flag + "="):
                    out.append(f"{flag}={_resolve_value(family, arg.split('=', 1)[1])}")
                    i += 1
                    break
            else:
                continue
            break
        else:
            out.append(arg)
            i += 1
    return out


def _load_config_with_names(text: str) -> object:
    """The YAML loader for config files: plugin names at the top level become class paths."""
    data = yaml.safe_load(text)
    if isinstance(data, dict):
        for family in registry.GROUPS:
            if family in data:
                data[family] = _resolve_value(family, data[family])
    return data


def _plugins_epilog() -> str:
    lines = ["installed plugins (show one's options with `gcore fit --<family>.help <name>`):"]
    for family in registry.GROUPS:
        lines.append(f"  --{family}: {', '.join(registry.names(family)) or '(none)'} (default {DEFAULTS[family]})")
    return "\n".join(lines)


def build_fit_parser():  # noqa: ANN201
    """The jsonargparse parser of ``gcore fit``."""
    from jsonargparse import ActionConfigFile, ArgumentParser, set_loader

    from gcore.algorithms.base import Algorithm
    from gcore.backends.base import TrainingBackend
    from gcore.data import DataConfig
    from gcore.engines.base import Engine
    from gcore.envs.base import Environment
    from gcore.model import ModelConfig
    from gcore.placement.base import PlacementPolicy
    from gcore.rewards.base import RewardModel
    from gcore.trainer import TrainerConfig
    from gcore.types import SamplingParams

    set_loader("gcore_yaml", _load_config_with_names, exceptions=(yaml.YAMLError,))
    from jsonargparse import DefaultHelpFormatter

    class _Formatter(DefaultHelpFormatter):
        def _fill_text(self, text, width, indent):  # noqa: ANN001, ANN202 - keep the epilog's lines
            return "".join(indent + line for line in text.splitlines(keepends=True))

    parser = ArgumentParser(
        formatter_class=_Formatter,
        prog="gcore fit",
        description="Train a policy with RL. Plugins: --engine, --reward, --algorithm, --placement, "
        "--backend take a name from `gcore plugins` or a class path; `--algorithm.help grpo` shows a "
        "plugin's own options.",
        parser_mode="gcore_yaml",
        epilog=_plugins_epilog(),
        exit_on_error=False,  # ``parse`` turns jsonargparse's usage dump and message into one line
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML config file (may repeat)")
    parser.add_class_arguments(TrainerConfig, "trainer")
    parser.add_class_arguments(ModelConfig, "model")
    parser.add_class_arguments(DataConfig, "data")
    parser.add_class_arguments(SamplingParams, "sampling")
    bases = {"engine": Engine, "reward": RewardModel, "algorithm": Algorithm,
             "placement": PlacementPolicy, "backend": TrainingBackend, "env": Environment}
    for family, base in bases.items():
        parser.add_subclass_arguments(base, family, required=True, fail_untyped=False)
    return parser


def _explain_plugin_error(config) -> None:  # noqa: ANN001 - a jsonargparse Namespace
    """jsonargparse wraps a constructor's error in a long message; rebuild each plugin to name it."""
    import importlib

    for family in registry.GROUPS:
        spec = config.get(family)
        if spec is None or not getattr(spec, "class_path", None):
            continue
        module, _, name = spec.class_path.rpartition(".")
        init_args = spec.init_args.as_dict() if getattr(spec, "init_args", None) is not None else {}
        try:
            getattr(importlib.import_module(module), name)(**init_args)
        except GcoreError:
            raise
        except Exception as err:  # noqa: BLE001  a plugin's constructor may raise anything; reported with its name
            raise GcoreError(f"--{family} {spec.class_path}: {type(err).__name__}: {err}") from None


def parse(parser, argv: Sequence[str]):  # noqa: ANN001, ANN201  a jsonargparse parser and Namespace
    """``parser.parse_args`` of ``argv`` with the plugin defaults; a bad option is a one-line ``ConfigError``
    naming the option and what it expected (jsonargparse would print the whole usage, 50 lines, first): a
    config file that is not YAML with its line and column, an unknown option with its file and line and
    the valid choices (``gcore.config_errors``)."""
    from jsonargparse import ArgumentError

    configs = config_paths(argv)
    for path in configs:  # yaml's own line and column, before jsonargparse folds them into its message
        check_config_file(path)
    try:
        return parser.parse_args(with_default_plugins(resolve_argv(argv)))
    except ArgumentError as err:
        unknown = unknown_option(str(err), parser)
        text = unknown.describe(configs) if unknown is not None else one_line(str(err), configs, argv)
        raise ConfigError(f"{text} (gcore fit --help lists the options)") from None


def one_line(message: str, configs: Sequence[str] = (), argv: Sequence[str] = ()) -> str:
    """jsonargparse's error message in one line: for a value of the wrong type the option's keys joined and the
    innermost expectation, where it was set: ``--trainer.max_steps: Expected a <class 'int'>. Got value: abc`` on
    the command line, ``cfg.yaml:3: trainer.max_steps: ...`` in the last of ``configs`` that sets it (a flag
    overrides a file, a later file an earlier one); any other message's lines joined."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    keys = [key for line in lines if (m := re.match(r'Parser key "([^"]+)":', line)) for key in m.group(1).split(".")]
    expected = next((line for line in lines if line.startswith("Expected a ") and "Got value" in line), None)
    if not keys or expected is None:
        return " ".join(lines)[:500]
    flag, got = f"--{'.'.join(keys)}", expected.partition("Got value: ")[2]
    # jsonargparse checks a config file as it reads it, before a flag that overrides the value
    where = "" if got in typed(flag, argv) else last_set(configs, keys)
    return f"{where}{'.'.join(keys)}: {expected}" if where else f"{flag}: {expected}"


def with_default_plugins(argv: Sequence[str]) -> list[str]:
    """Prepend ``--family DEFAULT`` for each family that neither argv nor a config file names; then the
    config files, then the class choices (``--family NAME``), then the other flags.

    A parser default would not do: jsonargparse keeps the default class's values for options of the
    same name when another class is chosen (``--algorithm ppo`` would inherit GRPO's ``kl_coef``).
    """
    named: set[str] = set()
    args, configs, choices, rest = list(argv), [], [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" and i + 1 < len(args) or arg.startswith("--config="):
            named.update(_families_in_config(arg.split("=", 1)[1] if "=" in arg else args[i + 1]))
            # a config file goes before the class choices: a flag overrides the file, whatever the order typed
            configs += [arg] if "=" in arg else [arg, args[i + 1]]
            i += 1 if "=" in arg else 2
            continue
        family = next((f for f in registry.GROUPS if arg in (f"--{f}", f"--{f}.class_path")), None)
        if family is not None and i + 1 < len(args):  # a class choice goes first, before its options
            named.add(family)
            choices += [arg, args[i + 1]]
            i += 2
            continue
        family = next((f for f in registry.GROUPS if arg.startswith((f"--{f}=", f"--{f}.class_path="))), None)
        if family is not None:
            named.add(family)
            choices.append(arg)
        else:
            rest.append(arg)
        i += 1
    defaults = [item for family in registry.GROUPS if family not in named
                for item in (f"--{family}", registry.resolve(family, DEFAULTS[family]))]
    return defaults + configs + choices + rest


def _families_in_config(path: str) -> set[str]:
    """The plugin families whose class a YAML config file names."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return set()  # jsonargparse reports the unreadable file itself
    if not isinstance(data, dict):
        return set()
    return {family for family in registry.GROUPS if isinstance(data.get(family), str)
            or (isinstance(data.get(family), dict) and "class_path" in data[family])}


def _instantiate(parser, config) -> dict[str, Any]:  # noqa: ANN001  a jsonargparse parser and Namespace
    """The ``Trainer``'s arguments: the configs and plugins built from ``config``."""
    try:
        init = parser.instantiate_classes(config)
    except GcoreError:
        raise
    except (TypeError, ValueError) as err:  # a plugin's constructor rejected its arguments
        _explain_plugin_error(config)
        raise GcoreError(f"invalid configuration: {str(err).splitlines()[0]}") from None
    return {key: init[key] for key in ("trainer", "model", "data", "sampling", *registry.GROUPS)}


def fit_main(argv: Sequence[str]) -> int:
    """``gcore fit``: parse, build every plugin, train."""
    from gcore.trainer import Trainer

    parser = build_fit_parser()
    config = parse(parser, argv)
    try:
        result = Trainer(**_instantiate(parser, config)).fit()
    except ConfigError as err:  # a check naming its option: where a config file set it, the file and line
        err.args = (placed(str(err), config_paths(argv), argv),)
        raise
    if result.run_dir is not None:
        print(f"metrics and config: {result.run_dir}")
    if result.final_model_dir is not None:
        print(f"trained policy (HF checkpoint): {result.final_model_dir}")
    return 0


def plugins_main(argv: Sequence[str]) -> int:
    """``gcore plugins``: every registered plugin, its class, its package, and import errors."""
    if argv:
        raise GcoreError(f"gcore plugins takes no arguments, got {' '.join(argv)}")
    failed = 0
    for family in registry.GROUPS:
        print(f"{family}s ({registry.GROUPS[family]}):")
        plugins = registry.discover(family)
        if not plugins:
            print("  (none)")
        for p in plugins:
            status = f"FAILED: {p.error}" if p.error else ""
            failed += bool(p.error)
            print(f"  {p.name:<14} {p.class_path:<48} [{p.package}] {status}".rstrip())
    if failed:
        print(f"\n{failed} plugin(s) failed to import; the others are usable", file=sys.stderr)
    return 0


def simulate_main(argv: Sequence[str]) -> int:
    """``gcore simulate``: the placement simulator (gcore/simulator/)."""
    from gcore.simulator.cli import main as simulate

    return simulate(list(argv))


def eval_main(argv: Sequence[str]) -> int:
    """``gcore eval``: ``gcore fit``'s model, data, sampling, engine and reward options; prints the metrics.

    One process (``gcore/evaluation.py`` has the metrics). Example: ``gcore eval --model.path final/
    --data.task arithmetic --data.chat_template true --reward math --sampling.max_new_tokens 48``.
    """
    import json
    import os
    import shutil
    import tempfile

    import torch

    from gcore.data import load_eval_prompts
    from gcore.evaluation import evaluate
    from gcore.model import load_tokenizer, materialize
    from gcore.rewards.base import prepare_judges

    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print("usage: gcore eval [gcore fit options]\n\nHeld-out accuracy of --model.path (greedy and at "
              "--sampling.temperature) on --data.eval_path, or on the embedded --data.task's held-out split.\n"
              "The --model, --data, --sampling, --engine, --reward and --env options are gcore fit's "
              "(gcore fit --help); the others are ignored.")
        return 0
    parser = build_fit_parser()
    config = parse(parser, argv)
    init = parser.instantiate_classes(config)
    model_config, data, sampling = init["model"], init["data"], init["sampling"]
    engine, reward, env = init["engine"], init["reward"], init["env"]
    device = torch.device("cuda" if torch.cuda.is_available() and init["trainer"].accelerator != "cpu" else "cpu")
    workdir = tempfile.mkdtemp(prefix="gcore-eval-")
    try:
        images = data.has_images
        tokenizer = load_tokenizer(model_config, vision=images)
        source = model_config.source(materialize(model_config, tokenizer, init["trainer"].seed, workdir, images))
        processor = None
        if images:  # image prompts (docs/multimodal.md): the model's processor places the images
            from gcore.vision import load_processor

            processor = load_processor(source.path, source.trust_remote_code)
        prompts = load_eval_prompts(data, tokenizer, sampling.max_new_tokens,
                                    source.context_length(), processor)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in sampling.stop_token_ids:
            sampling.stop_token_ids = (*sampling.stop_token_ids, tokenizer.eos_token_id)
        if not model_config.embedded:  # Gemma 3: <end_of_turn> ends a reply; float16 refused
            from gcore.model import family_checks

            extra = family_checks(source, getattr(engine, "dtype", None))
            sampling.stop_token_ids += tuple(t for t in extra if t not in sampling.stop_token_ids)
        torch.manual_seed(init["trainer"].seed)
        engine.setup(source, device)
        prepare_judges(reward, os.path.join(workdir, "judge"))  # a .gguf judge, converted into the eval's folder
        reward.setup(device)
        env.setup(tokenizer)
        metrics = evaluate(engine, reward, tokenizer, prompts, sampling, env=env)
    finally:
        engine.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(metrics, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    from gcore.checkpoint import export_main
    from gcore.model import import_main
    from gcore.report import report_main
    from gcore.tracing import samples_main

    commands = {"fit": fit_main, "plugins": plugins_main, "report": report_main, "export": export_main,
                "simulate": simulate_main, "import": import_main, "eval": eval_main,
                "samples": samples_main}
    if command not in commands:
        print(f"gcore: error: unknown command {command!r}; valid commands: {', '.join(commands)}", file=sys.stderr)
        return 2
    try:
        return commands[command](rest)
    except GcoreError as err:
        print(f"gcore: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (gcore.errors.Interrupted): 128 + the signal
        import signal

        signum = getattr(err, "signum", signal.SIGINT)
        print(f"gcore: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum


def entry() -> int:
    """The ``gcore`` command (and ``python -m gcore``): ``main``, then ``gc.freeze()`` before the process exits, so
    that the interpreter's last full garbage collection over every object left (torch's, transformers' modules) is
    skipped: 1.8 s of CPU for a process that only imported gcore and a model, more after a run (measured on the
    2-core CPU machine, benchmarks/results/ci_time.md). Not in ``main``, which tests call in their own process."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(entry())
