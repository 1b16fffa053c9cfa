"""benchmarks/_gpu_clocks.py reads `nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,pstate -lms` (here a
fake nvidia-smi on PATH that prints what the real one prints) and averages each GPU's SM clock over a span."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _gpu_clocks import ClockLog  # noqa: E402

pytestmark = pytest.mark.unit

# the GPU 0 clock rises from 345 to 1980 MHz after the first few samples; GPU 1 stays up
FAKE = """#!/bin/sh
i=0
while [ $i -lt 40 ]; do
  if [ $i -lt 5 ]; then c=345; else c=1980; fi
  echo "0, $c, 1980, P0"
  echo "1, 1980, 1980, P0"
  echo "garbage line"
  i=$((i + 1))
  sleep 0.02
done
sleep 30
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_each_gpu_clock_is_averaged_over_its_span(fake_smi):
    began = time.time()
    with ClockLog() as log:
        deadline = time.monotonic() + 10
        while len(log.samples) < 80 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert len(log.samples) == 80 and log.max_mhz == {0: 1980.0, 1: 1980.0}  # garbage lines skipped
    low_until = log.samples[9][0]  # GPU 0's fifth sample (two lines a sample)
    early, late = log.mean(began, low_until), log.mean(log.samples[10][0], time.time())
    assert early == {0: 345.0, 1: 1980.0} and late == {0: 1980.0, 1: 1980.0}
    report = log.report({"c=1": [(began, low_until), (log.samples[10][0], time.time())]})
    assert report.splitlines() == ["GPU 0 SM clock, mean MHz (max 1980) in each sweep: c=1 345 / 1980",
                                   "GPU 1 SM clock, mean MHz (max 1980) in each sweep: c=1 1980 / 1980"]


def test_without_nvidia_smi_the_report_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with ClockLog() as log:
        pass
    assert log.report({"c=1": [(0.0, time.time())]}) == "GPU SM clocks: not sampled (no nvidia-smi)"
