"""--in-allocation's checks of the shell's allocation, before anything is written."""

from __future__ import annotations

import pytest

from hpc.cli.main import main
from hpc.errors import UserError
from hpc.launch.allocation import current_allocation

pytestmark = pytest.mark.unit


@pytest.fixture
def no_allocation(monkeypatch, tmp_path):
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST",
                 "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    return monkeypatch


def test_no_allocation_is_one_line_with_the_fix_and_nothing_written(no_allocation, tmp_path, capsys):
    assert main(["launch", "-c", "dev", "-r", "tiny-disagg", "--in-allocation"]) == 2
    err = capsys.readouterr().err
    assert "--in-allocation: this shell holds no Slurm allocation (no SLURM_JOB_ID)" in err
    assert "salloc -N 3" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_an_allocation_too_small_for_the_plan_names_both_counts(no_allocation):
    no_allocation.setenv("SLURM_JOB_ID", "77")
    no_allocation.setenv("SLURM_JOB_NUM_NODES", "2")
    no_allocation.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    with pytest.raises(UserError, match="allocation 77 has 2 node"):
        current_allocation(3)
    found = current_allocation(2)
    assert (found.job_id, found.nodes, found.nodelist) == ("77", 2, "node[1-2]")


def test_a_local_profile_has_no_allocation(no_allocation, capsys):
    no_allocation.setenv("SLURM_JOB_ID", "77")
    assert main(["launch", "-c", "local", "-r", "tiny-agg", "--in-allocation"]) == 2
    assert "this cluster profile has no Slurm" in capsys.readouterr().err


def test_a_hetjob_cannot_run_in_an_allocation(no_allocation, capsys):
    no_allocation.setenv("SLURM_JOB_ID", "77")
    assert main(["launch", "-c", "dev", "-r", "tiny-disagg", "--set", "placement=hetjob", "--in-allocation"]) == 2
    assert "placement: hetjob asks Slurm for a heterogeneous job" in capsys.readouterr().err
