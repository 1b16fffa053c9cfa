"""The lock file CI installs from (.ci/requirements.lock): it pins every requirement of pyproject.toml inside its
range and everything those pull in, so a new release changes nothing until the lock is rewritten
(`python .ci/lock.py`); `.ci/run --latest` shows what the newest releases would change."""

from __future__ import annotations

import importlib.util
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.unit


def _lock_module():
    spec = importlib.util.spec_from_file_location("ci_lock", ROOT / ".ci" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = _lock_module().EXTRAS.split(",")
    assert set(extras) == set(project["optional-dependencies"])  # CI installs every extra
    lines = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return [r for r in map(Requirement, lines) if r.marker is None or r.marker.evaluate()]


def test_every_requirement_is_pinned_inside_its_range():
    lock = _lock_module()
    pins = lock.read_lock()
    for req in _requirements():
        name = lock.canonical(req.name)
        assert name in pins, f"{req} is not in .ci/requirements.lock: run python .ci/lock.py"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"{req}: the lock pins {pins[name]}; run python .ci/lock.py"


def test_what_the_pinned_packages_need_is_pinned_too():
    """The closure, read from the installed packages' metadata where the installed version is the locked one (in
    CI, all of them): `pip install -r` would pull an unpinned dependency's newest release."""
    lock = _lock_module()
    pins = lock.read_lock()
    checked = 0
    for name, version in pins.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if lock.public(dist.version) != version:
            continue
        checked += 1
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                assert lock.canonical(req.name) in pins, f"{name} needs {req}, which the lock does not pin"
    assert checked >= len(pins) // 2  # the check read most of the lock, not none of it


def test_compare_names_each_package_the_latest_install_changed():
    lock = _lock_module()
    pins = lock.read_lock()
    assert ("pytest", "0.0.1", lock.public(metadata.version("pytest"))) in lock.compare({**pins, "pytest": "0.0.1"})
    assert ("no-such-package", "1.0", "-") in lock.compare({"no-such-package": "1.0"})


def test_a_package_the_lock_does_not_name_is_listed():
    lock = _lock_module()
    pins = lock.read_lock()
    without_pytest = {n: v for n, v in pins.items() if n != "pytest"}
    assert ("pytest", lock.public(metadata.version("pytest"))) in lock.unlocked(without_pytest)
