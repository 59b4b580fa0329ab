"""The recipes' layout rules, held by reading the source: small files, short ``main`` functions, and the repo's own
code importing the package by its current module paths."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nlp_tricks._moved import MOVED, PUBLIC

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
MAX_RECIPE_FILE_LINES = 700
MAX_MAIN_LINES = 60
# The old module paths (nlp_tricks/_moved.py) but the public ones (nlp_tricks.losses, the documented name).
OLD_PATHS = {name for name in MOVED if name not in PUBLIC}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _recipe_files() -> list[Path]:
    return sorted(RECIPES.rglob("*.py"))


def _own_files() -> list[Path]:
    return sorted(p for folder in ("recipes", "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py"))


def long_mains(source: str, where: str) -> list[str]:
    """Every function called ``main`` (at any depth) longer than :data:`MAX_MAIN_LINES`, decorators left out."""
    return [
        f"{where}:{node.lineno} main ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name == "main"
        and node.end_lineno - node.lineno + 1 > MAX_MAIN_LINES
    ]


def old_imports(source: str, where: str) -> list[str]:
    """Every import of an old module path: ``import nlp_tricks.crf``, ``from nlp_tricks.crf import ...``,
    ``from nlp_tricks import crf`` (a submodule imported by its old name), at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found += [
            f"{where}:{node.lineno} {name}"
            for name in names
            if any(name == old or name.startswith(old + ".") for old in OLD_PATHS)
        ]
    return found


@pytest.mark.parametrize("path", _recipe_files(), ids=_relative)
def test_no_recipe_file_is_longer_than_700_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_RECIPE_FILE_LINES, f"{_relative(path)}: {lines} lines; split it by concern"


@pytest.mark.parametrize("path", _recipe_files(), ids=_relative)
def test_no_recipe_main_is_longer_than_60_lines(path):
    assert not long_mains(path.read_text(encoding="utf-8"), _relative(path)), "name its steps (_setup_model, ...)"


@pytest.mark.parametrize("path", _own_files(), ids=_relative)
def test_own_code_imports_no_old_module_path(path):
    assert not old_imports(path.read_text(encoding="utf-8"), _relative(path)), "import the path MOVED names"


def test_the_checks_find_what_they_look_for():
    body = "    x = 1\n" * (MAX_MAIN_LINES - 1)
    assert long_mains("class A:\n  def main(self):\n" + body + "    return x\n", "a.py")
    assert not long_mains("def main():\n" + body, "a.py")
    assert not long_mains("def other():\n" + body * 2, "a.py")
    old = sorted(OLD_PATHS)[0]
    package, _, leaf = old.rpartition(".")
    for source in (f"import {old}\n", f"from {old} import x\n", f"from {package} import {leaf}\n"):
        assert old_imports(f"def f():\n    {source}", "a.py"), source
    assert not old_imports("from nlp_tricks.losses import focal_loss\nimport nlp_tricks.losses\n", "a.py")
    assert not old_imports(f"from {MOVED[old]} import x\nfrom . import {leaf}\n", "a.py")
