"""--in-allocation inside `salloc -N 3` on the dev cluster: the run's steps in the allocation, smoke passing,
status naming the allocation, and cancel ending the run's steps while the allocation goes on."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.slurm.conftest import frontend_port

pytestmark = pytest.mark.slurm

INSIDE = """
set -u
hpc launch -c dev -r tiny-disagg --in-allocation --set {port}; echo "launch-rc=$?"
run=$(ls "$HPC_RUNS_DIR" | head -n 1)
hpc status "$run"
echo "steps-before-cancel=$(squeue -s -h -j "$SLURM_JOB_ID" | wc -l)"
hpc cancel "$run"; echo "cancel-rc=$?"
echo "allocation-after-cancel=$(squeue -h -j "$SLURM_JOB_ID" -o %T)"
squeue -s -h -j "$SLURM_JOB_ID" -o "left %i %j %T"
echo "steps-after-cancel=$(squeue -s -h -j "$SLURM_JOB_ID" -o %i | grep -vc -e batch -e extern -e interactive)"
"""


def test_a_run_in_salloc_passes_smoke_and_cancel_leaves_the_allocation(slurm_env, tmp_path):
    done = subprocess.run(["salloc", "-N", "3", "--gres=gpu:2", "--time=10", "bash", "-c",
                           INSIDE.format(port=frontend_port())],
                          env={**os.environ}, capture_output=True, text=True, timeout=400)
    out = done.stdout
    assert "launch-rc=0" in out, out + done.stderr
    assert "running in allocation " in out and "smoke: PASSED" in out
    assert "state: RUNNING in allocation " in out and "preflight: 3 nodes in " in out
    assert int(out.split("steps-before-cancel=")[1].split()[0]) >= 5  # etcd, nats, frontend, prefill, decode
    assert "cancel-rc=0" in out and "its steps ended; allocation " in out and "goes on" in out
    assert "allocation-after-cancel=RUNNING" in out
    assert "steps-after-cancel=0" in out, out
