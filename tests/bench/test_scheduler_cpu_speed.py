"""benchmarks/_scheduler_clock.scheduler_cpu_speed: each engine's scheduler-thread CPU speed at each level of each
sweep, from the reference the thread times on itself, against that engine's fastest level."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _scheduler_clock import scheduler_cpu_speed  # noqa: E402

pytestmark = pytest.mark.unit


def _clock(seconds: float, runs: int) -> dict[str, float]:
    return {"scheduler_cpu_reference_seconds_total": seconds, "scheduler_cpu_reference_runs_total": runs}


def test_each_level_reads_as_the_engines_fastest_mean_over_its_own():
    per_level = {1: [{"decode-0": _clock(4 * 20e-6, 4), "prefill-0": _clock(0.0, 0)},
                     {"decode-0": _clock(2 * 40e-6, 2), "prefill-0": _clock(30e-6, 1)}],
                 64: [{"decode-0": _clock(25e-6, 1), "prefill-0": _clock(60e-6, 2)},
                      {"decode-0": _clock(20e-6, 1), "prefill-0": _clock(30e-6, 1)}]}
    lines = scheduler_cpu_speed(per_level).splitlines()
    assert lines[1] == "  decode-0 (20.0 µs at its fastest): c=1 100% / 50%, c=64 80% / 100%", lines
    assert lines[2] == "  prefill-0 (30.0 µs at its fastest): c=1 - / 100%, c=64 100% / 100%", lines


def test_engines_that_never_timed_it_print_nothing():
    assert scheduler_cpu_speed({1: [{"decode-0": _clock(0.0, 0)}]}) == ""
