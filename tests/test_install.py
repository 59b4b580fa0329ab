"""The README's install and test lines are what CI runs, and its CPU line gives a small, CPU-only torch that
`pip install -e` keeps (the slow test builds a fresh virtual environment with it)."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def section(title: str) -> str:
    """The README's text from ``## title`` to the next ``## ``."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def first_bash_block(text: str) -> list[str]:
    """The lines of the first ```bash block in ``text``, each without its ``# comment``."""
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def extras(text: str) -> set[str]:
    (found,) = re.findall(r'pip install -e "\.\[([a-z,]+)\]"', text)
    return set(found.split(","))


def test_the_readme_test_command_is_the_one_ci_runs_at_the_floors():
    (command,) = first_bash_block(section("Test"))
    floors = CI[CI.index('echo "== floors') : CI.index('echo "== newest')]
    assert command in [line.strip() for line in floors.splitlines()]


def test_the_readme_test_install_names_the_extras_ci_installs_at_the_floors():
    (ci_extras,) = re.findall(r"^install floors (\S+) ", CI, re.M)
    assert extras(section("Test")) == set(ci_extras.split(","))
    assert extras(section("Install")) <= set(ci_extras.split(","))  # the newcomer's line: nothing CI does not test


def test_the_cpu_line_comes_before_the_two_commands_and_names_pytorchs_cpu_index():
    torch_line, install, ci = first_bash_block(section("Install"))
    assert shlex.split(torch_line) == ["pip", "install", "torch", "--index-url", PYTORCH_CPU_INDEX]
    assert install.startswith('pip install -e ".[demo,plot]" && accelerate launch --config_file ')
    assert ci == "bash .ci/run"


def torch_cpu_source() -> list[str]:
    """What installs torch's CPU build here: ``NLP_TRICKS_TORCH_CPU`` (pip arguments) when set, else a ``+cpu`` wheel
    file in pip's find-links (the README's fallback for a machine that cannot reach PyTorch's index), else the
    README's line itself."""
    if os.environ.get("NLP_TRICKS_TORCH_CPU"):
        return shlex.split(os.environ["NLP_TRICKS_TORCH_CPU"])
    links = (
        os.environ.get("PIP_FIND_LINKS")
        or subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
        ).stdout.strip()
    )
    wheels = sorted(w for folder in links.split() for w in glob.glob(os.path.join(folder, "torch-*+cpu-*.whl")))
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = [w for w in wheels if f"-{tag}-" in Path(w).name]
    return [wheels[-1]] if wheels else shlex.split(first_bash_block(section("Install"))[0])[2:]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.mark.slow  # a fresh environment: minutes of installing
def test_the_cpu_line_in_a_fresh_environment_gives_a_cpu_torch_that_the_install_keeps(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
    env.pop("PYTHONPATH", None)  # the environment's own packages, not the repository's checkout
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *torch_cpu_source()], check=True, env=env, timeout=1800)
    probe = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"

    def torch_build():
        return json.loads(subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True).stdout)

    before = torch_build()
    assert before[1] is None and "+cpu" in before[0], before
    subprocess.run([*pip, "-e", f"{ROOT}[demo,plot]"], check=True, env=env, timeout=1800, cwd=tmp_path)
    assert torch_build() == before  # pip kept the CPU build
    listed = subprocess.run([python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True)
    names = [p["name"].lower() for p in json.loads(listed.stdout)]
    assert not [n for n in names if n.startswith(("nvidia-", "triton"))], names
    # Measured with torch 2.13.0+cpu: 1.9 GB (torch 0.75 GB); PyPI's CUDA build on Linux makes it over 6 GB.
    size = folder_bytes(venv)
    assert size < 2.5e9, f"{size / 1e9:.2f} GB"
