"""``--trick module:Class``: a trick of the user's own (a :class:`nlp_tricks.Trick` subclass in their file) in any
recipe, with its own flags.

``module`` is importable from the working directory (``my_tricks:LogitPenalty``) or is a file
(``path/to/file.py:LogitPenalty``). A class that declares its argument dataclass as the built-in tricks do
(``arguments = LogitPenaltyArguments``) gets every field as a recipe flag: in ``--help`` (its ``help`` metadata),
parsed and checked as the built-in flags are, settable from a YAML / JSON config file. The trick is built as the
built-ins are: ``Class.validate(args)`` when it has one (a ``ValueError`` names the field), then
``Class.from_args(args)`` (``None``: off for these values), else ``Class(args)``, or ``Class()`` for a class without
arguments; ``args`` is its own argument dataclass. Each trainer a recipe builds gets fresh instances
(:func:`user_tricks`), passed as ``TricksTrainer(..., tricks=[...])``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple

from nlp_tricks import Trick

# Where the parsed settings ride on the training arguments: plain data (the spec and the field values), so that the
# Trainer's pickled training_args.bin and a deepcopy carry them.
_SETTINGS = "_user_trick_settings"


class TrickError(ValueError):
    """A ``--trick`` that cannot be used: its one-line reason, naming the flag's value."""


class UserTrick(NamedTuple):
    """A ``--trick`` value, loaded: the spec as given, the class, its argument dataclass (or None)."""

    spec: str
    cls: type
    arguments: type | None


def trick_specs(argv: list[str]) -> list[str]:
    """Every ``--trick`` value in a command line, in order (``--trick a --trick b``, ``--trick a b``,
    ``--trick=a``)."""
    specs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("--trick="):
            specs.append(arg.split("=", 1)[1])
        elif arg == "--trick":
            while i < len(argv) and not argv[i].startswith("-"):
                specs.append(argv[i])
                i += 1
    return specs


def config_trick_specs(path: str) -> list[str]:
    """The ``trick`` key of a YAML / JSON config file (one spec or a list), read leniently: the recipe's reading of
    the file reports what is wrong with it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        if path.endswith(".json"):
            import json

            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except Exception:  # an unreadable file: the config file reader says why, in one line
        return []
    value = values.get("trick") if isinstance(values, dict) else None
    if isinstance(value, str):
        return [value]
    return [str(item) for item in value] if isinstance(value, list) else []


def load_trick(spec: str) -> UserTrick:
    """The class a ``--trick`` value names, checked: one :class:`TrickError` line for a module that does not import,
    a missing class, a class that is not a ``Trick``, ``arguments`` that are not a dataclass."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise TrickError(f"--trick {spec}: expected module:Class or path/to/file.py:Class")
    module = _import(spec, where)
    cls = getattr(module, name, None)
    if cls is None:
        found = sorted(
            k
            for k, v in vars(module).items()
            if isinstance(v, type) and issubclass(v, Trick) and v.__module__ == module.__name__
        )
        hint = f" (its Trick classes: {', '.join(found)})" if found else ""
        raise TrickError(f"--trick {spec}: {where} has no class {name!r}{hint}")
    if not (isinstance(cls, type) and issubclass(cls, Trick)):
        raise TrickError(f"--trick {spec}: {name} is not a subclass of nlp_tricks.Trick")
    arguments = getattr(cls, "arguments", None)
    if arguments is not None and not (isinstance(arguments, type) and dataclasses.is_dataclass(arguments)):
        raise TrickError(f"--trick {spec}: {name}.arguments must be a dataclass (its fields become the trick's flags)")
    return UserTrick(spec, cls, arguments)


def _import(spec: str, where: str):
    """The module ``where`` names: a ``.py`` file (by path), or a module importable from the working directory."""
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise TrickError(f"--trick {spec}: no such file {where}")
        # One module per file, under a name of its own: dataclasses and typing look their class up in sys.modules.
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        module_name = f"nlp_tricks_user_{path.stem}_{digest}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise TrickError(f"--trick {spec}: importing {where} failed: {_one_line(err)}") from err
        return module
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # after the recipe's own folder, so a user module cannot shadow common/
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        if err.name is not None and where.split(".")[0] == err.name.split(".")[0]:
            raise TrickError(
                f"--trick {spec}: no module named {where!r} in the working directory {os.getcwd()} (or give a file: "
                "path/to/file.py:Class)"
            ) from err
        raise TrickError(f"--trick {spec}: importing {where} failed: {_one_line(err)}") from err
    except Exception as err:
        raise TrickError(f"--trick {spec}: importing {where} failed: {_one_line(err)}") from err


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def load_user_tricks(specs: list[str], taken: set[str]) -> list[UserTrick]:
    """The tricks of ``specs``; a spec given twice, or a flag of a trick's arguments that ``taken`` (the recipe's
    flags) or another trick already has, is one :class:`TrickError` line."""
    loaded, names = [], set(taken)
    for spec in specs:
        if spec in (t.spec for t in loaded):
            raise TrickError(f"--trick {spec}: given twice")
        trick = load_trick(spec)
        for f in dataclasses.fields(trick.arguments) if trick.arguments else ():
            if f.init and f.name in names:
                raise TrickError(
                    f"--trick {spec}: its argument {f.name!r} is already a flag of this recipe (or of another "
                    "--trick); rename the field"
                )
            names.add(f.name)
        loaded.append(trick)
    return loaded


def build_trick(trick: UserTrick, args) -> Trick | None:
    """The trick as the built-ins are built from their arguments ``args`` (see the module docstring); ``None`` when
    ``from_args`` leaves it off. A ``ValueError`` or ``TypeError`` is one :class:`TrickError` line."""
    cls = trick.cls
    try:
        if hasattr(cls, "validate"):
            cls.validate(args)
        if hasattr(cls, "from_args"):
            return cls.from_args(args)
        return cls(args) if trick.arguments is not None else cls()
    except (ValueError, TypeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TrickError(f"--trick {trick.spec}: {reason}") from err


def attach_user_tricks(training_args, tricks: list[UserTrick], trick_arguments: list) -> None:
    """Check that each trick builds from its parsed arguments (``trick_arguments``: one dataclass instance per trick
    with arguments, in order), then keep their settings on ``training_args`` for :func:`user_tricks`."""
    settings, given = [], iter(trick_arguments)
    for trick in tricks:
        args = next(given) if trick.arguments is not None else None
        build_trick(trick, args)
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init} if args else None
        settings.append((trick.spec, values))
    setattr(training_args, _SETTINGS, tuple(settings))


def user_tricks(training_args) -> list[Trick]:
    """Fresh instances of the ``--trick`` tricks the recipe's arguments were parsed with (none: ``[]``), for
    ``TricksTrainer(..., tricks=...)``."""
    built = []
    for spec, values in getattr(training_args, _SETTINGS, ()):
        trick = load_trick(spec)
        args = trick.arguments(**values) if trick.arguments is not None else None
        instance = build_trick(trick, args)
        if instance is not None:
            built.append(instance)
    return built
