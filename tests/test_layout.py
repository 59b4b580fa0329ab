"""The package's layout rules, held by reading its source: the trainer's size, the length of every function, which
package may import which, and the built-in tricks' naming and arguments (docs/tricks.md, "Adding a built-in
trick")."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nlp_tricks"
MAX_FUNCTION_LINES = 60
MAX_TRAINER_LINES = 750


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _modules(folder: str = "") -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def _long_functions(source: str, where: str) -> list[str]:
    return [
        f"{where}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def _imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports (at the top or inside a function), as absolute dotted names."""
    package = ["nlp_tricks", *path.relative_to(PACKAGE).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
    return found


def _imports_from(path: Path, *packages: str) -> list[str]:
    return [m for m in _imported_modules(path) if any(m == p or m.startswith(p + ".") for p in packages)]


def test_the_trainer_module_stays_small():
    lines = len((PACKAGE / "trainer.py").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_TRAINER_LINES, f"nlp_tricks/trainer.py has {lines} lines; move a cohesive part to runtime/"


@pytest.mark.parametrize("path", _modules(), ids=_relative)
def test_no_function_is_longer_than_60_lines(path):
    assert not _long_functions(path.read_text(encoding="utf-8"), _relative(path))


def test_the_length_check_counts_a_methods_lines():
    body = "    x = 1\n" * (MAX_FUNCTION_LINES - 1)
    assert not _long_functions("class A:\n  def f(self):\n" + body, "a.py")
    assert _long_functions("class A:\n  def f(self):\n" + body + "    y = 2\n", "a.py") == ["a.py:2 f (61 lines)"]


@pytest.mark.parametrize("path", _modules("functional"), ids=_relative)
def test_the_math_imports_nothing_from_runtime_or_tricks(path):
    assert not _imports_from(path, "nlp_tricks.runtime", "nlp_tricks.tricks", "nlp_tricks.trainer")


@pytest.mark.parametrize("path", _modules("runtime"), ids=_relative)
def test_the_runtime_imports_nothing_from_tricks(path):
    assert not _imports_from(path, "nlp_tricks.tricks")


def test_the_import_reader_resolves_relative_imports():
    """The check above reads ``from ..runtime.x import y`` and a function's own ``from ..tricks import z``."""
    imported = _imported_modules(PACKAGE / "runtime" / "state_store.py")
    assert "nlp_tricks.runtime.resume" in imported and "transformers" in imported
    assert "nlp_tricks.functional.models" in _imported_modules(PACKAGE / "functional" / "averaging.py")
    assert "nlp_tricks.functional.versions" in _imported_modules(PACKAGE / "functional" / "crf.py")


def _built_in_tricks():
    from nlp_tricks.tricks import BUILT_IN_TRICKS

    return BUILT_IN_TRICKS


@pytest.mark.parametrize("cls", _built_in_tricks(), ids=lambda cls: cls.__name__)
def test_each_built_in_trick_is_named_after_its_file_and_its_fields_are_arguments(cls):
    from nlp_tricks import TricksConfig
    from nlp_tricks.seq2seq import Seq2SeqTricksArguments
    from nlp_tricks.tricks.base import BuiltInTrick

    module = cls.__module__
    stem = module.rsplit(".", 1)[1]
    assert module == f"nlp_tricks.tricks.{stem}" and issubclass(cls, BuiltInTrick)
    # <Flag>Trick: the file's name in CamelCase (acronyms in capitals: crf.py -> CRFTrick), then "Trick".
    assert re.fullmatch(r"[A-Z][A-Za-z]*Trick", cls.__name__), cls.__name__
    assert cls.__name__.lower() == stem.replace("_", "") + "trick", f"{stem}.py holds {cls.__name__}"
    assert importlib.import_module(module).__dict__[cls.__name__] is cls
    assert dataclasses.is_dataclass(cls.arguments) and all(
        f.metadata.get("help") for f in dataclasses.fields(cls.arguments)
    )
    holder = TricksConfig if cls.in_tricks_config else Seq2SeqTricksArguments
    fields = {f.name for f in dataclasses.fields(holder)}
    assert {f.name for f in dataclasses.fields(cls.arguments)} <= fields and cls.arguments in holder.__mro__


def test_tricks_config_is_the_registrys_arguments_in_its_order():
    from nlp_tricks import TricksConfig
    from nlp_tricks.runtime.divergence import RunSafetyArguments

    groups = [cls.arguments for cls in _built_in_tricks() if cls.in_tricks_config] + [RunSafetyArguments]
    expected = [f.name for group in groups for f in dataclasses.fields(group)]
    assert [f.name for f in dataclasses.fields(TricksConfig)] == expected


# The built-ins' names before the <Flag>Trick scheme (docs and user code import them): the same classes.
OLD_NAMES = {
    "tie_encoder_decoder": "TieEncoderDecoder", "pooling": "PoolingHead", "reinit_layers": "ReinitLayers",
    "scheduled_sampling": "ScheduledSampling", "crf": "CRFHead", "head_dropout": "MultiSampleDropoutHead",
    "rdrop": "RDrop", "smart": "SmoothnessRegularization", "distillation": "Distillation", "loss_type": "LossFunction",
    "adversarial": "Adversarial", "sam": "SharpnessAwareMinimization", "ema": "ExponentialMovingAverage",
    "swa": "CheckpointAveraging", "freeze_layers": "LayerFreezing", "layer_decay": "LayerwiseLearningRates",
    "loraplus": "LoraPlus",
}  # fmt: skip


def test_the_old_names_of_the_built_ins_are_the_same_classes():
    by_file = {cls.__module__.rsplit(".", 1)[1]: cls for cls in _built_in_tricks()}
    for stem, old in OLD_NAMES.items():
        assert getattr(importlib.import_module(f"nlp_tricks.tricks.{stem}"), old) is by_file[stem], old
