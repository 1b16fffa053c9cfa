"""benchmarks/cpu_siblings.py: hidden hyperthread siblings of a VM found by timing (a stand-in clock here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cpu_siblings  # noqa: E402

pytestmark = pytest.mark.unit


def test_pairs_slowed_both_ways_are_siblings_and_one_way_is_not():
    ratios = {(0, 1): 1.6, (1, 0): 1.5, (0, 2): 1.0, (2, 0): 1.3, (1, 2): 1.0, (2, 1): 1.05}
    assert cpu_siblings.siblings(ratios, 1.2) == [(0, 1, 1.6, 1.5)]  # 2 slowed by 0, not 0 by 2: no sibling
    one_way = {**ratios, (1, 3): 1.4, (3, 1): 1.0}  # the lower-numbered CPU slowed, the other not: no sibling
    assert cpu_siblings.siblings(one_way, 1.2) == [(0, 1, 1.6, 1.5)]
    lines = cpu_siblings.report([0, 1, 2], ratios, 1.2)
    assert "0<-1 1.60x" in lines[1] and "2<-0 1.30x" in lines[1]
    assert lines[2].endswith("0+1 (1.60x/1.50x)")
    assert cpu_siblings.report([0, 1, 2], {k: 1.0 for k in ratios}, 1.2)[2].endswith("none")
    # a CPU whose speed moved on its own while the pairs were timed is named first
    drifted = cpu_siblings.report([0, 1, 2], ratios, 1.2, {0: 1.0, 1: 1.9, 2: 0.98})[3]
    assert drifted.startswith("each CPU alone, at the end / at the start: 1 1.90x") and "(median 1.00x)" in drifted


def test_every_ordered_pair_is_timed_against_the_cpu_alone(monkeypatch):
    """A stand-in clock: CPU 1 runs half as fast while the spinner is on CPU 3, its host sibling."""
    monkeypatch.setattr(cpu_siblings.os, "sched_setaffinity", lambda pid, cpus: spinner_on.update(
        {"cpu": next(iter(cpus))}) if pid != 0 else None)
    spinner_on = {"cpu": None}
    sibling = {1: 3, 3: 1}

    class Spinner:  # the spinning process, killed at the end
        pid = 99

        def send_signal(self, sig):
            spinner_on["cpu"] = None

        def wait(self):
            return -9
    monkeypatch.setattr(cpu_siblings.subprocess, "Popen", lambda *args, **kwargs: Spinner())

    def timed(cpu):
        return 2.0 if sibling.get(cpu) == spinner_on["cpu"] else 1.0

    ratios, drift = cpu_siblings.slowdowns([0, 1, 2, 3], 100, 1, timed)
    assert len(ratios) == 12 and (1, 1) not in ratios
    assert drift == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}  # timed alone again once the spinner is gone
    assert {k for k, r in ratios.items() if r > 1} == {(1, 3), (3, 1)}
    assert cpu_siblings.siblings(ratios, 1.2) == [(1, 3, 2.0, 2.0)]


def test_the_loop_runs_and_calibrates():
    assert cpu_siblings.loop_seconds(1000) > 0
    assert cpu_siblings.calibrate(1.0) >= 1000
