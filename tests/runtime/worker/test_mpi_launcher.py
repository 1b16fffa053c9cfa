"""A worker whose ranks start under an MPI launcher (TensorRT-LLM's trtllm-llmapi-launch under Slurm): the
launcher and everything it starts ignore the drain signal, which Slurm sends every process of the step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
FAKE = Path(__file__).resolve().parents[2] / "fakes" / "trtllm"


def _ignored(status: str) -> set[int]:
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return {sig for sig in range(1, 65) if mask & (1 << (sig - 1))}


def test_the_worker_becomes_its_launcher_with_the_drain_signal_ignored(tmp_path):
    seen = tmp_path / "seen"
    launcher = tmp_path / "launch"
    launcher.write_text(f'#!/bin/sh\ncat /proc/self/status > {seen}.status\nprintf "%s\\n" "$@" > {seen}\n')
    launcher.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", "hpc.runtime.worker", "/runs/r/manifest.json", "--role", "prefill",
                           "--index", "1", "--attempt", "2", "--mpi-launcher", str(launcher)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert seen.read_text().splitlines() == [sys.executable, "-m", "hpc.runtime.worker", "/runs/r/manifest.json",
                                             "--role", "prefill", "--index", "1", "--attempt", "2"]
    assert signal.SIGUSR1 in _ignored(Path(f"{seen}.status").read_text())
    assert signal.SIGTERM not in _ignored(Path(f"{seen}.status").read_text())  # the end of the step still ends it


def test_a_launcher_the_image_lacks_is_one_line_and_exit_127():
    done = subprocess.run([sys.executable, "-m", "hpc.runtime.worker", "/runs/r/manifest.json", "--role", "agg",
                           "--mpi-launcher", "no-such-launcher-hpc"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 127
    assert done.stderr.strip().splitlines() == [
        "hpc worker: cannot start no-such-launcher-hpc (No such file or directory); this image lacks it: use one "
        "with TensorRT-LLM's launcher on PATH"]


@pytest.mark.parametrize("wrapped", [True, False], ids=["under-the-worker", "bare"])
def test_trtllm_ranks_outlive_the_drain_signal_only_when_started_through_the_worker(tmp_path, wrapped):
    """Slurm signals every process of a step (proctrack): here, one process group per rank. The command of rank
    0 stands in for our worker: it handles USR1 itself, as serve.py does."""
    log = tmp_path / "fake.jsonl"
    env = {**os.environ, "PATH": f"{FAKE / 'bin'}:{os.environ['PATH']}", "FAKE_TRTLLM_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]), "SLURM_NTASKS": "2"}
    worker = tmp_path / "worker.py"  # a file: the launcher splits its command at spaces
    worker.write_text("import signal, time\n"
                      "signal.signal(signal.SIGUSR1, lambda *a: print('drain', flush=True))\ntime.sleep(30)\n")
    command = [sys.executable, str(worker)]
    ranks = []
    for rank in (0, 1):
        if wrapped:  # as exec_under_launcher (the test above): ignore, then become the launcher
            argv = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
                    "os.execvp(sys.argv[1], sys.argv[1:])", "trtllm-llmapi-launch", *command]
        else:
            argv = ["trtllm-llmapi-launch", *command]
        ranks.append(subprocess.Popen(argv, env={**env, "SLURM_PROCID": str(rank)}, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
                log.exists() and {"mgmn_leader_start", "mgmn_worker_start"} <= {
                    json.loads(line)["event"] for line in log.read_text().splitlines()}):
            time.sleep(0.1)
        time.sleep(0.5)  # rank 0's command installed its handler
        for proc in ranks:
            os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        alive = [proc.poll() is None for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
    assert alive == ([True, True] if wrapped else [False, False])
    if wrapped:  # and the worker itself got the signal: it drains
        assert ranks[0].stdout.read().split() == ["drain"]
