"""The lock file: every test and build dependency of hpc at one version, so that CI is not broken by a release.

    python .ci/lock.py            resolve the extras CI installs (pip's own resolver, this machine's indexes) and
                                  write .ci/requirements.lock
    python .ci/lock.py --compare  after `.ci/run --latest` installed the newest releases: what differs from the lock

`.ci/run` installs `-r .ci/requirements.lock`, then hpc itself without dependencies; tests/test_lock.py fails when a
requirement of pyproject.toml is missing from the lock or pinned outside its range (re-lock after changing one).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / ".ci" / "requirements.lock"
EXTRAS = "serve,mpi,dev,kernels,nixl"  # what .ci/run installs


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def public(version: str) -> str:
    """2.13.0+cpu -> 2.13.0: a local label names one index's build (here the CPU wheel that the machine's pip
    constraint picks); `==2.13.0` matches it there and the platform's own build elsewhere."""
    return version.split("+", 1)[0]


def resolve() -> dict[str, str]:
    """{name: version} of everything `pip install -e .[EXTRAS]` would install into an empty environment."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), "-e", f"{ROOT}[{EXTRAS}]"], check=True)
        items = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): public(i["metadata"]["version"]) for i in items
            if canonical(i["metadata"]["name"]) != "hpc"}


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version
    return pins


def write_lock(pins: dict[str, str]) -> None:
    pip = metadata.version("pip")
    python = ".".join(map(str, sys.version_info[:2]))
    header = [f"# hpc's test and build dependencies (extras {EXTRAS}), resolved by pip {pip} for CPython {python}",
              "# on linux x86_64. Written by `python .ci/lock.py`; .ci/run installs exactly these.",
              f"pip=={public(pip)}"]
    LOCK.write_text("\n".join(header + [f"{n}=={v}" for n, v in sorted(pins.items())]) + "\n")


def compare(lock: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, locked, installed) for each locked package whose installed version differs; '-' where absent."""
    rows = []
    for name, locked in sorted(lock.items()):
        try:
            installed = public(metadata.version(name))
        except metadata.PackageNotFoundError:
            installed = "-"
        if installed != locked:
            rows.append((name, locked, installed))
    return rows


def unlocked(lock: dict[str, str]) -> list[tuple[str, str]]:
    """(name, installed) for each installed package the lock does not name: a dependency a newer release added."""
    installed = {canonical(d.metadata["Name"]): public(d.version) for d in metadata.distributions()}
    return sorted((n, v) for n, v in installed.items() if n not in lock and n not in ("hpc", "pip"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="show what the installed versions change")
    args = parser.parse_args(argv)
    if args.compare:
        rows = compare(read_lock())
        new = unlocked(read_lock())
        print(f"latest: {len(rows)} of the locked packages differ from {LOCK.relative_to(ROOT)}, "
              f"{len(new)} installed are not in it")
        width = max([len(r[0]) for r in rows + new] + [7])  # type: ignore[operator]
        for name, locked, installed in rows:
            print(f"  {name:<{width}}  {locked:>14} -> {installed}")
        for name, installed in new:
            print(f"  {name:<{width}}  {'(not locked)':>14} -> {installed}")
        return 0
    write_lock(resolve())
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(read_lock())} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
