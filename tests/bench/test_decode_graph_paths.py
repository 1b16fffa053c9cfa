"""benchmarks/decode_graph_paths.py: its batch sizes, and a bad list refused with one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import decode_graph_paths  # noqa: E402

pytestmark = pytest.mark.unit


def test_sizes_are_positive_integers_sorted_once_each():
    assert decode_graph_paths.parse_sizes("64,8,1,8") == [1, 8, 64]
    for bad in ("0,8", "-1", "8,,16", "eight", "1,$(reboot)", "1;`id`", "4\n8"):
        assert decode_graph_paths.parse_sizes(bad) is None, bad


def test_a_bad_size_list_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "decode_graph_paths.py"), "--sizes", "1,'$(x)'"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--sizes" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
