"""A recipe's ``--config``-style file (``recipe.py run.yaml``): its values, each checked as its flag would be.

A value in the file goes through the same conversion and checks as the same value typed after its flag, and a
wrong one gets the message argparse gives for it on the command line, naming the file and the key
(``run.yaml: max_steps: invalid int value: '[1, 2]'``). What the command line cannot express is kept where the
field's type admits it: ``null`` for an optional field, a mapping for a dict field (``lr_scheduler_kwargs``), a list
for a list field; a single value for a list flag is a list of one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def is_config_file(arg: str) -> bool:
    """Whether a command line's first argument names a config file (``run.yaml``) rather than a flag."""
    return arg.endswith(CONFIG_SUFFIXES) and not arg.startswith("-")


def read_config_file(parser: argparse.ArgumentParser, path: str, dataclass_types: tuple) -> dict:
    """The values of a YAML / JSON config file, checked against the parser's flags (one line per problem, exit 2):
    unknown keys first, with the closest known name, then each value as its flag would check it."""
    values = _load(parser, path)
    actions = flag_actions(parser)
    for key in values:
        if key not in actions:
            close = difflib.get_close_matches(str(key), list(actions), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            parser.error(f"{path}: unknown key {key!r}{hint}")
    kinds = _field_kinds(dataclass_types)
    return {
        key: _checked_value(parser, f"{path}: {key}", value, actions[key], kinds.get(key, set()))
        for key, value in values.items()
    }


def flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each destination's argparse action: the one of ``--name`` (not its ``--no_name`` complement)."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest != "help" and (action.dest not in found or f"--{action.dest}" in action.option_strings):
            found[action.dest] = action
    return found


def _load(parser: argparse.ArgumentParser, path: str) -> dict:
    """The file's mapping of argument names to values (``{}`` for an empty file)."""
    file = Path(path)
    if not file.is_file():
        parser.error(f"{path}: no such config file")
    try:
        text = file.read_text(encoding="utf-8")
        if file.suffix == ".json":
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        parser.error(f"{path}: cannot read it ({str(err).splitlines()[0]})")
    except Exception as err:  # yaml.YAMLError, without importing yaml for JSON users
        parser.error(f"{path}: not valid YAML ({str(err).splitlines()[0]})")
    if values is None:
        return {}
    if not isinstance(values, dict):
        parser.error(f"{path}: expected a mapping of argument names to values")
    return values


def _field_kinds(dataclass_types: tuple) -> dict[str, set[type]]:
    """Which of ``None``, ``dict`` and ``list`` each field's annotation admits (``dict | str | None``: both)."""
    kinds = {}
    for dtype in dataclass_types:
        hints = typing.get_type_hints(dtype)
        for f in dataclasses.fields(dtype):
            hint = hints.get(f.name)
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            options = typing.get_args(hint) if union else (hint,)
            kinds[f.name] = {
                kind
                for option in options
                for kind in (type(None), dict, list)
                if (typing.get_origin(option) or option) is kind
            }
            if f.default is None:
                kinds[f.name].add(type(None))
    return kinds


def _checked_value(parser: argparse.ArgumentParser, where: str, value, action: argparse.Action, kinds: set[type]):
    """The file's ``value`` as the command line would give it for ``action``'s flag, or exit with argparse's line."""
    if value is None and type(None) in kinds:
        return None
    if isinstance(value, dict) and dict in kinds:
        return value
    if action.nargs in ("+", "*"):
        return [_converted(parser, where, item, action) for item in (value if isinstance(value, list) else [value])]
    if isinstance(value, list) and list in kinds:
        return value
    return _converted(parser, where, value, action)


def _converted(parser: argparse.ArgumentParser, where: str, value, action: argparse.Action):
    """One value through the flag's own type and choices, as the text a user would type for it."""
    text = value if isinstance(value, str) else _as_typed(value)
    try:
        converted = parser._get_value(action, text)
        parser._check_value(action, converted)
    except argparse.ArgumentError as err:
        # A choice flag's "no" written unquoted: YAML has read it as false, which no choice is.
        quote = (
            "; YAML reads an unquoted no / yes / off / on as a boolean: quote it"
            if isinstance(value, bool) and action.choices
            else ""
        )
        parser.error(f"{where}: {err.message}{quote}")
    if value is None or isinstance(value, list | dict):
        # A text flag takes any text, but a list or a mapping is never one flag's single value.
        type_name = getattr(action.type, "__name__", "str") if action.type is not None else "str"
        parser.error(f"{where}: invalid {type_name} value: {text!r}")
    return converted


def _as_typed(value) -> str:
    """A YAML / JSON value as it would be typed on the command line (``true``, ``1.5``, ``[1, 2]``, ``null``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None or isinstance(value, list | dict):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)
