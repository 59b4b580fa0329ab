"""CI tests the lowest versions pyproject.toml allows: .ci/floors.txt pins each floor, and .ci/run installs them."""

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
