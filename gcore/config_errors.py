"""``gcore fit``'s configuration errors in one line naming the file and line: a ``--config`` file that is
not valid YAML (yaml's own marks), and an option that does not exist, in a config file or on the command
line, with the valid choices (the names jsonargparse's parser holds) and the closest one."""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from gcore.errors import ConfigError

#: top-level names of the parser that are no section of a config file
_NOT_SECTIONS = {"help", "config", "print_config", "print_shtab"}


def config_paths(argv: Sequence[str]) -> list[str]:
    """The ``--config`` files of ``argv``, in order."""
    paths = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
        elif arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
    return paths


def check_config_file(path: str) -> None:
    """A ``ConfigError`` naming the file, line and column when ``path`` cannot be read or is not valid YAML
    (a ``!!python/...`` tag included: config files are read with ``yaml.safe_load``)."""
    try:
        with open(path, encoding="utf-8") as f:
            yaml.safe_load(f)
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {path}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except yaml.MarkedYAMLError as err:
        raise ConfigError(f"--config {_where(path, err)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML ({err})") from None


def _where(path: str, err: yaml.MarkedYAMLError) -> str:
    """``cfg.yaml:4:1: expected ',' or ']' (while parsing a flow sequence at line 3, column 9)``."""
    mark = err.problem_mark or err.context_mark
    at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    text = f"{at}: {err.problem or err.context}"
    if err.context and err.problem:
        context_mark = err.context_mark
        place = f" at line {context_mark.line + 1}, column {context_mark.column + 1}" if context_mark else ""
        text += f" ({err.context}{place})"
    return text


@dataclass(frozen=True)
class UnknownOption:
    """An option jsonargparse refused: its keys (``["trainer", "checkpoint_evry"]``), the names valid in
    its place, and the class whose option it would be (a plugin's)."""

    keys: tuple[str, ...]
    choices: tuple[str, ...]
    owner: str | None = None

    def describe(self, configs: Sequence[str]) -> str:
        """The one line: where (the config file and line, or the command line's ``--`` flag), the option,
        the closest valid name and the valid names."""
        where = locate(configs, self.keys)
        dash = "" if where else "--"
        name, parent = dash + ".".join(self.keys), dash + ".".join(self.keys[:-1]) if self.keys[:-1] else ""
        of = f" of {self.owner}" if self.owner else ""
        close = difflib.get_close_matches(self.keys[-1], self.choices, n=1)
        hint = f" (did you mean {'.'.join((parent, close[0])) if parent else dash + close[0]}?)" if close else ""
        under = f" under {parent}" if parent else ""
        return f"{where}unknown option {name}{of}{hint}; valid choices{under}: {', '.join(self.choices)}"


_GROUP = re.compile(r"Group '([^']+)' does not accept option '([^']+)'")
_CLASS = re.compile(r"Parser key \"([^\"]+)\":.*?Problem with given class_path '([^']+)':\s*Option '([^']+)' is "
                    r"not accepted", re.S)
_OPTION = re.compile(r"Option '([^']+)' is not accepted")
_FLAG = re.compile(r"unrecognized arguments: --([^\s=]+)")


def unknown_option(message: str, parser) -> UnknownOption | None:  # noqa: ANN001  a jsonargparse parser
    """The option jsonargparse's ``message`` refuses as unknown, with the valid choices; ``None`` for
    any other error."""
    if m := _CLASS.search(message):
        family, class_path, option = m.groups()
        return UnknownOption((family, option), _class_options(class_path), owner=class_path)
    if m := _GROUP.search(message):
        return UnknownOption((*m.group(1).split("."), m.group(2)), _options(parser, m.group(1)))
    if m := _OPTION.search(message) or _FLAG.search(message):
        return _by_name(parser, m.group(1))
    return None


def _by_name(parser, name: str) -> UnknownOption:  # noqa: ANN001  a jsonargparse parser
    """``trainr.max_steps``: the first of its keys that is no option, and the choices in its place."""
    keys = name.split(".")
    prefix: list[str] = []
    for key in keys[:-1]:
        if key not in _options(parser, ".".join(prefix)):
            break
        prefix.append(key)
    return UnknownOption((*prefix, keys[len(prefix)]), _options(parser, ".".join(prefix)))


def _options(parser, prefix: str) -> tuple[str, ...]:  # noqa: ANN001  a jsonargparse parser
    """The names one level under ``prefix`` (``""``: the config file's sections)."""
    names: dict[str, None] = {}
    for action in parser._actions:
        dest = str(action.dest)
        if prefix and not dest.startswith(prefix + "."):
            continue
        rest = dest[len(prefix) + 1:] if prefix else dest
        name = rest.split(".")[0]
        if name and name not in _NOT_SECTIONS:
            names[name] = None
    return tuple(names)


def _class_options(class_path: str) -> tuple[str, ...]:
    """The options of a plugin class, as jsonargparse reads them from its signature."""
    from jsonargparse import ArgumentParser

    module, _, name = class_path.rpartition(".")
    parser = ArgumentParser()
    parser.add_class_arguments(getattr(importlib.import_module(module), name), fail_untyped=False)
    return _options(parser, "")


_NAMED_FLAG = re.compile(r"--([A-Za-z_]\w*(?:\.\w+)+)")


def placed(message: str, configs: Sequence[str], argv: Sequence[str]) -> str:
    """A check's message that begins with the option it refuses (``--trainer.max_steps must be >= 1, got -1``),
    with the option's file and line in its stead when a config file set it and the command line did not
    (``cfg.yaml:2: trainer.max_steps must be >= 1, got -1``); any other message as it is."""
    m = _NAMED_FLAG.match(message)
    if m is None or not configs or typed(m.group(0), argv):
        return message
    where = last_set(configs, m.group(1).split("."))
    return f"{where}{message[2:]}" if where else message


def typed(flag: str, argv: Sequence[str]) -> list[str]:
    """The values the command line gives ``flag`` (``--a.b v`` or ``--a.b=v``); empty when it does not name it."""
    values = [after for arg, after in zip(argv, [*argv[1:], ""], strict=True) if arg == flag]
    return values + [arg.partition("=")[2] for arg in argv if arg.startswith(f"{flag}=")]


def last_set(configs: Sequence[str], keys: Sequence[str]) -> str:
    """``locate`` in the last of ``configs`` that sets ``keys``: a later config file overrides an earlier one."""
    return locate(list(reversed(configs)), keys)


def locate(configs: Sequence[str], keys: Sequence[str]) -> str:
    """``cfg.yaml:3: ``: the file and line of the last of ``keys`` in the first config file that holds them
    all (a plugin's options may sit under ``init_args``); empty when none does (a command-line option)."""
    for path in configs:
        try:
            with open(path, encoding="utf-8") as f:
                node = yaml.compose(f, Loader=yaml.SafeLoader)
        except (OSError, yaml.YAMLError):
            continue
        line = _line_of(node, keys)
        if line is not None:
            return f"{path}:{line + 1}: "
    return ""


def _line_of(node: yaml.Node | None, keys: Sequence[str]) -> int | None:
    """The line (from 0) of the last of ``keys``, each under the one before, or ``None``."""
    line = None
    for key in keys:
        found = _key_node(node, key)
        if found is None:
            return None
        line, node = found
    return line


def _key_node(node: yaml.Node | None, key: str) -> tuple[int, yaml.Node] | None:
    """(The line of ``key``, its value) in a YAML mapping node, looking under ``init_args`` too."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for name, value in node.value:
        if name.value == key:
            return name.start_mark.line, value
    for name, value in node.value:
        if name.value == "init_args":
            return _key_node(value, key)
    return None
