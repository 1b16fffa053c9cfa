"""placement: hetjob on the dev cluster: one component per role (#SBATCH hetjob), each step in its component
(srun --het-group), smoke passing across them, and cancel ending every component."""

from __future__ import annotations

import subprocess

import pytest

from hpc.cli.main import main
from hpc.rundir import list_runs
from hpc.slurm.client import SlurmClient
from tests.slurm.conftest import SLURM_CONF, frontend_port

pytestmark = pytest.mark.slurm


def test_a_hetjob_places_each_role_in_its_component_passes_smoke_and_cancels(slurm_env, capsys):
    assert main(["launch", "-c", "dev", "-r", "tiny-disagg", "--set", "placement=hetjob",
                 "--set", frontend_port()]) == 0
    out = capsys.readouterr().out
    assert "smoke: PASSED" in out
    (run,) = list_runs()
    script = run.script_path.read_text()
    assert script.count("#SBATCH hetjob") == 2  # services, prefill, decode
    job_id = run.job_id()
    components = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %N"], capture_output=True, text=True,
                                env={"SLURM_CONF": SLURM_CONF, "PATH": "/usr/bin:/bin"}).stdout.split("\n")
    by_component = dict(line.split() for line in components if line.strip())
    assert sorted(by_component) == [f"{job_id}+0", f"{job_id}+1", f"{job_id}+2"]
    assert len(set(by_component.values())) == 3  # a node each
    states = run.component_states()
    assert states["prefill-0"]["node"] == by_component[f"{job_id}+1"]
    assert states["decode-0"]["node"] == by_component[f"{job_id}+2"]
    assert main(["status", job_id]) == 0
    status = capsys.readouterr().out
    assert "state: RUNNING" in status and "preflight: 3 nodes in " in status and "roles: prefill 1/1 ok" in status
    assert main(["cancel", job_id]) == 0
    st = SlurmClient(slurm_env).status(job_id)
    assert st is None or st.finished, st
