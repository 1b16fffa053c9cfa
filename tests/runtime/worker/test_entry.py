"""The worker process's end: bounded, whatever its client libraries do once the job's servers are gone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.unit

STUBBORN = """
import asyncio, sys
from hpc.runtime.worker.entry import run_bounded

async def reconnecting_forever():  # what a client whose server died with the job may do
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            continue

async def polite():
    await asyncio.sleep(10)

async def serve():
    loop = asyncio.get_running_loop()
    loop.create_task(polite())
    if sys.argv[1] == "stubborn":
        loop.create_task(reconnecting_forever())
    await asyncio.sleep(0.1)
    return 7

code = run_bounded(serve(), grace_s=1)
print("returned", code, flush=True)
sys.exit(code)
"""


@pytest.mark.parametrize("tasks", ["stubborn", "polite"])
def test_the_worker_exits_with_its_code_even_when_a_task_ignores_cancellation(tasks):
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUBBORN, tasks], capture_output=True, text=True, timeout=30)
    assert done.returncode == 7 and time.monotonic() - t0 < 10
    if tasks == "stubborn":  # gone after the grace, with the task's name for whoever reads the log
        assert done.stdout == "" and "1 task(s) that ignored cancellation for 1 s" in done.stderr
        assert "reconnecting_forever" in done.stderr
    else:  # the ordinary end: main's value returned, nothing said
        assert done.stdout == "returned 7\n" and done.stderr == ""
