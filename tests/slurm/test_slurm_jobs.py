"""Submission, placement, states, logs, failure and MPI on the real dev cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from hpc.cli.main import main
from hpc.rundir import list_runs
from hpc.slurm.client import SlurmClient
from tests.slurm.conftest import dev_cluster_file

pytestmark = pytest.mark.slurm
PROBE = str(Path(__file__).with_name("probe.py"))


def _wait_finished(client: SlurmClient, job_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        st = client.status(job_id)
        if st is not None:
            if not seen or seen[-1] != st.state:
                seen.append(st.state)
            if st.finished and (st.steps or st.state != "COMPLETED"):
                return st, seen
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish: {seen}")


def _submit_probe(tmp_path, fail: str | None = None):
    cluster = dev_cluster_file(tmp_path, python=PROBE)
    assert main(["launch", "-c", cluster, "-r", "tiny-disagg", "--no-wait", "--no-smoke",
                 "--set", "roles.prefill.tensor_parallel_size=2"]) == 0
    (run,) = list_runs()
    if fail:
        (run.path / "probe").mkdir(exist_ok=True)
        (run.path / "probe" / "fail").write_text(fail)
    return run


def test_every_step_runs_on_its_planned_node_and_gpus(slurm_env, tmp_path):
    t0 = time.monotonic()
    run = _submit_probe(tmp_path)
    client = SlurmClient(slurm_env)
    job_id = run.run_info().job_id
    st, seen = _wait_finished(client, job_id)
    # COMPLETING is Slurm's passing state while steps are torn down; a poll may or may not see it.
    assert st.state == "COMPLETED" and seen[-1] == "COMPLETED" and \
        set(seen) <= {"PENDING", "RUNNING", "COMPLETING", "COMPLETED"}
    records = [json.loads(p.read_text()) for p in (run.path / "probe").glob("*.json")]
    by = {(r["component"], r["procid"]): r for r in records}
    plan = run.manifest().plan
    nodes = sorted({r["host"] for r in records})
    assert nodes == ["node1", "node2", "node3"]
    for s in plan.services:  # node index i is the i-th node of the allocation
        assert by[(s.name, "0")]["host"] == f"node{s.node + 1}"
    for w in plan.workers:
        for rank in w.ranks:
            rec = by[(w.name, str(rank.rank))]
            assert rec["host"] == f"node{rank.node + 1}"
            assert rec["localid"] == str(rank.local_rank)
            assert rec["ntasks"] == str(w.tasks)
            visible = rec["cuda"].split(",")
            assert len(visible) == w.gpus_per_node and str(rank.local_rank) in visible
    assert (run.logs / "prefill-0.log").is_file() and (run.logs / "job.out").is_file()
    print(f"probe job: submit -> COMPLETED in {time.monotonic() - t0:.2f} s")


def test_failed_step_shows_failed_with_step_and_exit_code(slurm_env, tmp_path, capsys):
    run = _submit_probe(tmp_path, fail="decode-0")
    client = SlurmClient(slurm_env)
    job_id = run.run_info().job_id
    st, _ = _wait_finished(client, job_id)
    assert st.state == "FAILED"
    (step,) = [s for s in st.steps if s.exit_code == 3 and s.step_id != "batch"]
    assert step.name == "decode-0"
    capsys.readouterr()
    assert main(["status", job_id]) == 0
    out = capsys.readouterr().out
    assert "state: FAILED" in out and "decode-0 exit 3" in out


def test_submit_failure_prints_slurms_message_and_marks_run(slurm_env, tmp_path, capsys):
    cluster = dev_cluster_file(tmp_path, partition="no-such-partition")
    assert main(["launch", "-c", cluster, "-r", "tiny-agg", "--no-wait"]) == 1
    err = capsys.readouterr().err
    assert "invalid partition" in err.lower()
    (run,) = list_runs()
    info = run.run_info()
    assert info.submitted is False and "partition" in (info.submit_error or "").lower()


def test_mpi4py_over_pmix_spans_two_nodes(slurm_env, tmp_path):
    prog = tmp_path / "hello.py"
    prog.write_text("from mpi4py import MPI\nimport socket\nc = MPI.COMM_WORLD\n"
                    "s = c.allreduce(c.Get_rank())\nprint(c.Get_rank(), c.Get_size(), socket.gethostname(), s)\n")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = subprocess.run(["srun", "--mpi=pmix", "-N2", "--ntasks-per-node=2", "python3", str(prog)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = sorted(line.split() for line in out.stdout.splitlines() if line.strip())
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and {r[1] for r in rows} == {"4"}
    assert {r[2] for r in rows} == {"node1", "node2"} and {r[3] for r in rows} == {"6"}


def test_a_run_directory_its_nodes_cannot_open_fails_with_that_reason(slurm_env, tmp_path, capsys):
    """The batch node cannot open RUN/logs/job.out (here logs/ is gone after the dry run, as a login node's local
    disk is from a compute node): Slurm fails the job at launch (exit 0:53, JobLaunchFailure) and there is no log
    to read, so the launch and hpc status say where runs must live instead."""
    import shutil

    from hpc.launch.slurm import SlurmBackend

    assert main(["launch", "-c", "dev", "-r", "tiny-agg", "--dry-run"]) == 0
    (run,) = list_runs()
    shutil.rmtree(run.logs)
    capsys.readouterr()
    assert SlurmBackend().submit(run, wait=True, smoke=False) == 1
    err = capsys.readouterr().err
    assert "the job wrote no log" in err and "runs_dir, or HPC_RUNS_DIR" in err
    assert f"job {run.job_id()} ended FAILED before it was ready" in err
    assert main(["status", run.job_id()]) == 0
    out = capsys.readouterr().out
    assert "state: FAILED" in out and "the job wrote no log" in out
    assert main(["logs", run.job_id()]) == 0 and "the job wrote no log" in capsys.readouterr().out


def test_a_model_directory_the_nodes_lack_stops_the_job_before_any_server_with_one_line(slurm_env, tmp_path,
                                                                                        capsys):
    missing = tmp_path / "models" / "No Such Model"
    t0 = time.monotonic()
    assert main(["launch", "-c", "dev", "-r", "tiny-agg", "--set", "model.generate=null",
                 "--set", f"model.path={missing}"]) == 1
    err = capsys.readouterr().err
    # every node checks it (the services' node1 and the worker's node2): the launch shows one node's line
    assert re.search(f"preflight failed: hpc preflight on node[12]: the model directory {re.escape(str(missing))} "
                     r"\(recipe model.path\) is not there; put it on a filesystem every node mounts, or fix the "
                     "path", err), err
    (run,) = list_runs()
    assert sorted(p.name for p in run.logs.iterdir()) == ["job.out", "preflight.log"]  # no server started
    assert time.monotonic() - t0 < 30
