"""hpc installed from a wheel (pip install git+..., or a wheel built once for a login node) works as a checkout does:
the wheel carries the templates, cluster profiles, recipes, engine configs and scripts (pyproject.toml's
data-files), and hpc finds them where pip put them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("templates", "clusters", "recipes", "engine_configs", "scripts", "vendor")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the tracked tree (no build isolation: offline)."""
    out = tmp_path_factory.mktemp("wheel")
    tree = out / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in filter(None, files.stdout.split("\0")):
        if (ROOT / name).is_file() and not name.startswith("tests/"):
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(out / "dist"), str(tree)], check=True, capture_output=True, timeout=300)
    (built,) = (out / "dist").glob("hpc-*.whl")
    return built


def test_the_wheel_carries_every_file_a_checkout_keeps_beside_hpc(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {name.split("/data/share/hpc/", 1)[1] for name in names if "/data/share/hpc/" in name}
    tracked = subprocess.run(["git", "ls-files", *SHIPPED], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked and set(tracked) == shipped, sorted(set(tracked) ^ shipped)  # a new folder: list it in pyproject
    assert "hpc/data/trtllm-llm-args.json" in names


def test_hpc_installed_from_the_wheel_renders_a_recipe_from_anywhere(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def hpc(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(python), "-m", "hpc", *args], cwd=elsewhere, capture_output=True, text=True,
                              timeout=120)

    where = subprocess.run([str(python), "-c", "import hpc; print(hpc.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where  # the wheel's hpc, not the checkout's
    listed = hpc("recipes")
    assert listed.returncode == 0 and "deepseek-r1-disagg" in listed.stdout and "tiny-disagg" in listed.stdout
    rendered = hpc("render", "-c", "eos", "-r", "llava-epd")  # its engine configs come from the wheel too
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=" in rendered.stdout
