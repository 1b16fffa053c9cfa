"""benchmarks/_cpu_speed.py: a probe process times a fixed piece of interpreter work over and over; a span's speed
is the run's fastest span's median over its own."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _cpu_speed import CpuSpeedLog  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_probe_process_reports_its_reference_time_every_few_tens_of_ms():
    with CpuSpeedLog(min_cpus=1) as log:
        began = time.time()
        time.sleep(1.0)
        ended = time.time()
    inside = [(us, cpu) for t, us, cpu in log.samples if began <= t <= ended]
    assert 10 <= len(inside) <= 60, log.samples  # one line per ~20 ms plus 20 reference runs
    assert all(1 < us < 50_000 and cpu in os.sched_getaffinity(0) for us, cpu in inside), inside
    assert log._proc.poll() is not None  # stopped with the block


def test_each_span_reads_as_the_fastest_spans_median_over_its_own():
    log = CpuSpeedLog(min_cpus=1)
    # c=1: 100 µs in both sweeps; c=8: 100 then 125 µs (a fifth slower), with one outlier that the median drops
    # (on CPU 0 but for the slower span's, on CPU 5)
    log.samples = [(t, 100.0, 0) for t in (1, 2, 3, 11, 12, 13, 21, 22)] + \
        [(t, us, 5) for t, us in ((31, 125.0), (32, 125.0), (33, 900.0))]
    line = log.report({"c=1": [(0, 5), (10, 15)], "c=8": [(20, 25), (30, 35)], "c=32": [(40, 45), (50, 55)]})
    assert line.endswith("c=1 100% / 100%, c=8 100% / 80%, c=32 - / -; on each CPU it ran on (samples): "
                         "0 100% (8), 5 80% (3)"), line
    assert "100.0 µs" in line


def test_too_few_cpus_runs_no_probe_and_says_so():
    with CpuSpeedLog(min_cpus=10_000) as log:
        pass
    assert log._proc is None and log.samples == []
    assert "not probed" in log.report({"c=1": [(0.0, 1.0)]})
