"""Another commit's code beside this one, for an A/B on the GPU machine (whose copy of the tree has no git
history, so `git archive` cannot run there):

    python benchmarks/ab_tree.py COMMIT [--into ab_old]

writes COMMIT's `hpc/` and the files it reads at run time (templates, recipes, clusters, engine_configs) into
`ab_old/` (git-ignored, and carried with `carry: ["ab_old"]`). Run the old side with
`PYTHONPATH=$PWD/ab_old:$PWD` before the new side's path, and the benchmarks from this tree's `benchmarks/`.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import tarfile
from pathlib import Path

TREES = ("hpc", "templates", "recipes", "clusters", "engine_configs")


def build(commit: str, into: Path, repo: Path) -> list[str]:
    """COMMIT's TREES under `into` (emptied first); the top-level names written."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit, *TREES],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"ab_tree: git archive {commit}: {archive.stderr.decode().strip()}")
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return sorted(p.name for p in into.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("commit")
    parser.add_argument("--into", default="ab_old")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    written = build(args.commit, repo / args.into, repo)
    print(f"{args.commit} -> {args.into}/: {', '.join(written)}")


if __name__ == "__main__":
    main()
