"""benchmarks/_profile.py reads py-spy's raw output (`record --format raw --threads --subprocesses`): the lines
below have the shape py-spy 0.4 writes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _profile  # noqa: E402

pytestmark = pytest.mark.unit

SUPERVISOR = 'process 10:"python -m hpc.runtime.worker m.json --role decode"'
WORKER = 'process 11:"python -m hpc.runtime.worker m.json --role decode --no-supervise"'
RAW = "\n".join([
    f"{SUPERVISOR};thread (10): MainThread;Popen._try_wait (/usr/lib/python3.12/subprocess.py:2011) 50",
    f"{SUPERVISOR};{WORKER};thread (12): torch-engine;Thread._bootstrap (/usr/lib/python3.12/threading.py:1030);"
    "TorchEngine._schedule (/w/hpc/runtime/engine/torch/engine.py:419);sample_rows (/w/hpc/runtime/engine/"
    "sampling.py:63) 30",
    f"{SUPERVISOR};{WORKER};thread (12): torch-engine;Thread._bootstrap (/usr/lib/python3.12/threading.py:1030);"
    "TorchEngine._schedule (/w/hpc/runtime/engine/torch/engine.py:419) 10",
    f"{SUPERVISOR};{WORKER};thread (11): MainThread;Runner.run (/usr/lib/python3.12/asyncio/runners.py:118);"
    "encode_frame (/w/hpc/runtime/serve/wire.py:271) 10",
])


def test_gil_samples_are_shared_out_by_thread_and_function(tmp_path):
    path = tmp_path / "decode-0.gil.txt"
    path.write_text(RAW)
    head, self_line, inclusive = _profile.summary(path, "gil")
    assert head.startswith("  100 samples") and "torch-engine (pid 11) 40%" in head
    assert "MainThread (pid 10) 50%" in head and "MainThread (pid 11) 10%" in head  # two processes, two threads
    assert "sample_rows (sampling.py) 30.0%" in self_line and "Popen._try_wait (subprocess.py) 50.0%" in self_line
    assert "TorchEngine._schedule (engine.py) 40%" in inclusive
    assert "threading.py" not in inclusive and "runners.py" not in inclusive  # bootstrap frames say nothing


def test_wall_samples_show_where_each_thread_was_by_line(tmp_path):
    path = tmp_path / "decode-0.wall.txt"
    path.write_text(RAW)
    lines = _profile.summary(path, "wall")
    engine = next(line for line in lines if "torch-engine" in line)
    assert "(40 samples)" in engine and "sample_rows (sampling.py:63) 75%" in engine
    assert "TorchEngine._schedule (engine.py:419) 25%" in engine
    inclusive = lines[lines.index(engine) + 1]  # the thread's functions wherever on its stack: a step's parts
    assert inclusive.startswith("    inclusive: ") and "TorchEngine._schedule (engine.py) 100%" in inclusive
    assert "sample_rows (sampling.py) 75%" in inclusive and "threading.py" not in inclusive


def test_wall_samples_leave_out_threads_parked_on_one_line(tmp_path):
    """The supervisor waits on its child all the time: six busier threads would push the engine's out."""
    path = tmp_path / "decode-0.wall.txt"
    path.write_text(RAW)
    lines = _profile.summary(path, "wall")
    assert not any("Popen._try_wait" in line for line in lines)
    assert sum("wall, " in line for line in lines) == 2  # the engine's thread and the worker's loop
