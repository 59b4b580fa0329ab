"""CI tests both ends of the versions pyproject.toml allows: .ci/floors.txt pins each floor, and .ci/run installs them
(and, in a second environment, the newest releases) and runs the README's commands."""

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _floors() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    floors = {}
    for requirement in requirements:
        match = re.match(r"^([A-Za-z0-9_.-]+)\s*(>=|==)\s*([0-9][^,;\s]*)", requirement)
        assert match, f"pyproject.toml: {requirement!r} has no floor (name>=version)"
        floors[match.group(1).lower().replace("_", "-")] = match.group(3)
    return floors


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, pinned = line.split("==")
            pins[name.lower().replace("_", "-")] = pinned
    return pins


def test_ci_pins_every_floor_of_pyproject():
    assert _pins() == _floors(), "pyproject.toml floors and .ci/floors.txt differ: change them together"


def test_installed_versions_meet_the_floors():
    def key(v):
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])

    for name, floor in _floors().items():
        installed = version(name)
        assert key(installed) >= key(floor), f"{name} {installed} is below the floor {floor} in pyproject.toml"


def _readme_block(heading: str) -> list[str]:
    """The lines of the first ```bash block under README.md's ``## heading``."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_ci_installs_the_floors_and_runs_the_readmes_test_command_verbatim():
    run = (ROOT / ".ci" / "run").read_text()
    assert "install floors test,demo,plot -c .ci/floors.txt" in run
    (command,) = _readme_block("Test")
    assert f"\n    {command}\n" in run, f".ci/run does not run the README's test command {command!r} verbatim"


def test_readme_set_up_is_two_lines_the_second_being_what_ci_runs():
    """The CPU build's line (for machines without a GPU), then the two commands: install and the main job, CI."""
    cpu, install, test = _readme_block("Install")
    assert cpu.startswith("pip install torch --index-url ") and cpu.endswith("/cpu")
    assert "recipes/ner.py" in install and "torch==" not in install
    assert test == "bash .ci/run"
