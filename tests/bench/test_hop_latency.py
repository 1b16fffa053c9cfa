"""benchmarks/hop_latency.py: a round trip between two processes, each way the echo side can wait."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hop_latency.py"
pytestmark = pytest.mark.unit


def test_each_way_of_waiting_gives_a_round_trip_in_microseconds_after_each_idle_time():
    done = subprocess.run([sys.executable, str(SCRIPT), "--trips", "50", "--spin-us", "0,20", "--gap-us", "0,500"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [row.rsplit(maxsplit=4) for row in done.stdout.strip().splitlines()[2:]]
    ways = ["select", "select after a 20 µs spin", "event loop"]
    assert [(row[0].strip(), float(row[1])) for row in rows] == [(way, gap) for gap in (0, 500) for way in ways]
    for row in rows:
        p50, p99 = map(float, row[-2:])
        assert 0 < p50 <= p99 < 1e6  # a round trip measured, in µs, not seconds


@pytest.mark.parametrize("option", ["--spin-us", "--gap-us"])
@pytest.mark.parametrize("bad", ["x", "1;$(id)", "`id`", "5,\n"])
def test_a_bad_list_is_one_line_and_exit_2(option, bad):
    done = subprocess.run([sys.executable, str(SCRIPT), option, bad], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and option in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""
