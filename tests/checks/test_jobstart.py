"""The job's first step: the job records itself (a plain `sbatch job.sbatch` too) so that hpc finds it, and what
an earlier job of the same run directory left moves aside, so that readiness reads only this job's states."""

from __future__ import annotations

import json

import pytest

from hpc import rundir
from hpc.checks.jobstart import start
from hpc.checks.preflight import main
from hpc.cli.runtime_commands import _slurm_state
from hpc.render.sbatch import render_sbatch
from hpc.resolve import resolve
from hpc.rundir import find_run, write_json

pytestmark = pytest.mark.unit


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    return rundir.create(resolve("dev", "tiny-agg"), render_sbatch, root=tmp_path)


def test_a_dry_run_submitted_with_plain_sbatch_is_found_by_its_job_id(run, monkeypatch, capsys):
    assert not run.submitted() and _slurm_state(run)["state"] == "NOT SUBMITTED"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert main([str(run.manifest_path)]) == 0  # the preflight, on the batch node of a job without containers
    assert run.job() == {"job_id": "4242", "started_at": run.job()["started_at"], "submitted_by": "sbatch"}
    assert run.submitted() and run.job_id() == "4242"
    assert find_run("4242").path == run.path  # hpc status / logs / cancel 4242
    assert "job 4242 serves" in capsys.readouterr().out
    assert not (run.path / "previous").exists()  # a fresh directory: nothing to move
    assert run.run_info().submitted is False  # run.json stays the launcher's


def test_an_earlier_jobs_states_and_endpoints_move_aside(run):
    # hpc launch submitted job 41 (its smoke checks through submitit); job 42 is the same script sent again
    run.update_run_info(submitted=True, scheduler="slurm", job_id="41", smoke_via="submitit")
    write_json(run.state / "decode-0.json", {"phase": "failed", "error": "the earlier job's"})
    write_json(run.path / "endpoints" / "etcd.json", {"health": "http://10.0.0.9:2379/health"})
    write_json(run.path / "smoke.json", {"passed": True})
    moved = start(run, "42", now=0.0)
    assert moved == run.path / "previous" / "41-19700101-000000"
    assert json.loads((moved / "state" / "decode-0.json").read_text())["phase"] == "failed"
    assert (moved / "endpoints" / "etcd.json").is_file() and (moved / "smoke.json").is_file()
    # readiness sees no stale failure or endpoint; the components write theirs afresh
    assert not list(run.state.glob("*.json")) and not (run.path / "endpoints").exists()
    assert run.job_id() == "42" and run.job()["submitted_by"] == "sbatch"
    assert find_run("41").path == find_run("42").path == run.path
    # a third job moves the second one's record too
    assert start(run, "43", now=60.0) == run.path / "previous" / "42-19700101-000100"
    assert run.job_id() == "43"


@pytest.mark.parametrize("launched, by", [
    ({"job_id": "7", "smoke_via": "submitit"}, "hpc launch"),  # the job hpc launch submitted
    ({"smoke_via": "submitit"}, "hpc launch"),  # it started before hpc launch wrote the id sbatch gave it
    ({"smoke_via": "submitit", "submit_error": "sbatch: invalid partition"}, "sbatch"),  # launch's sbatch failed
])
def test_who_submitted_the_job(run, launched, by):
    run.update_run_info(**launched)
    start(run, "7")
    assert run.job()["submitted_by"] == by and run.job_id() == "7"


@pytest.mark.parametrize("by, runs", [("hpc launch", False), ("sbatch", True)])
def test_the_jobs_own_smoke_stage_stands_aside_only_for_the_job_hpc_launch_smokes(run, monkeypatch, by, runs):
    from hpc.checks import smoke

    ran = []
    monkeypatch.setattr(smoke, "run_smoke", lambda manifest: ran.append(manifest) or {"passed": True, "checks": []})
    run.update_run_info(submitted=True, scheduler="slurm", job_id="7", smoke_via="submitit")
    start(run, "7" if by == "hpc launch" else "8")
    assert run.job()["submitted_by"] == by
    assert smoke.main([str(run.manifest_path)]) == 0
    assert bool(ran) is runs
