"""benchmarks/ab_tree.py: another commit's code and run-time files, side by side with this tree's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ab_tree  # noqa: E402

pytestmark = pytest.mark.unit


def test_a_commits_code_and_run_time_files_are_written_whole(tmp_path):
    into = tmp_path / "ab_old"
    (into / "hpc").mkdir(parents=True)
    (into / "hpc" / "stale.py").write_text("left from an earlier commit")
    written = ab_tree.build("HEAD", into, ROOT)
    assert written == sorted(ab_tree.TREES)
    assert (into / "hpc" / "__init__.py").is_file() and not (into / "hpc" / "stale.py").exists()
    assert (into / "recipes" / "tiny-disagg.yaml").is_file() and any((into / "templates").iterdir())


def test_an_unknown_commit_is_one_clear_line(tmp_path):
    with pytest.raises(SystemExit, match="ab_tree: git archive no-such-commit"):
        ab_tree.build("no-such-commit", tmp_path / "ab_old", ROOT)
    assert not (tmp_path / "ab_old").exists()  # nothing written
