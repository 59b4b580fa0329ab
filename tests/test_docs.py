"""Every relative link in README.md and docs/ resolves: the file exists and, for `page.md#anchor`, so does the
heading (GitHub's anchor rules: lower case, punctuation dropped, spaces to hyphens)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    found = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        found.add(slug)
    return found


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(ROOT) if ROOT in file.parents else file})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_cite_no_tracker_issue_and_no_test_run_counts(page):
    """Docs say what is true now: an issue number or a count of passed tests from one run goes stale."""
    text = page.read_text(encoding="utf-8")
    stale = re.findall(r"\bissue #?\d+|\bissues? #\d+|\d+ (?:passed|failed|xfailed|skipped)\b|\bxfail", text, re.I)
    assert not stale, f"{page.name}: {stale}"
