"""After a launch: Ctrl-C while waiting for readiness stops the waiting, not the run, and says how to reach it."""

from __future__ import annotations

import time

import pytest

from hpc import rundir
from hpc.launch.follow import follow_up
from hpc.launch.local import LocalBackend
from hpc.render.sbatch import render_sbatch
from hpc.resolve import resolve

pytestmark = pytest.mark.unit


class _Smoke:
    cancelled = False

    def cancel(self, check: bool = True) -> None:
        self.cancelled = True


def test_ctrl_c_while_waiting_names_the_run_cancels_the_smoke_and_leaves_the_run(tmp_path, monkeypatch, capsys):
    run = rundir.create(resolve("local", "tiny-agg"), render_sbatch, root=tmp_path)
    run.update_run_info(submitted=True, scheduler="local", job_id=run.path.name)
    smoke = _Smoke()
    monkeypatch.setattr("hpc.launch.smoke.start_smoke", lambda run, backend, wait_ready_s: smoke)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("hpc.checks.ready.wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):  # main() turns it into exit 130
        follow_up(run, time.monotonic(), LocalBackend(), wait=True, smoke=True)
    err = capsys.readouterr().err
    assert f"hpc status {run.path.name}" in err and f"hpc cancel {run.path.name}" in err
    assert smoke.cancelled and run.path.is_dir()


def test_a_preflight_failure_is_the_failing_nodes_line_not_the_jobs_record(tmp_path):
    from hpc.launch.follow import preflight_failure

    run = rundir.create(resolve("dev-containers", "tiny-agg"), render_sbatch, root=tmp_path)
    log = run.logs / "preflight.log"
    log.write_text("hpc preflight on node1: ok (Python 3.12 torch=2.13)\nhpc: job 42 serves /runs/x\n")
    assert preflight_failure(run) is None  # the first task's record of the job is no failure
    log.write_text(log.read_text() + "hpc preflight on node2: aetcd is not installed in the image\n")
    assert preflight_failure(run) == "hpc preflight on node2: aetcd is not installed in the image"


def test_a_smoke_job_ends_at_once_when_readiness_gave_up(tmp_path):
    """No checks against a stack that never got ready, and no cancel needed: a local smoke job's controller,
    cancelled, prints a KeyboardInterrupt traceback into the launch's output."""
    from hpc.checks.smoke import run_smoke_when_ready
    from hpc.rundir import write_json

    run = rundir.create(resolve("local", "tiny-agg"), render_sbatch, root=tmp_path)
    write_json(run.state / "ready.json", {"phase": "nats healthy", "ready": False, "gave_up": "frontend failed"})
    t0 = time.monotonic()
    verdict = run_smoke_when_ready(str(run.manifest_path), wait_ready_s=60)
    assert verdict == {"passed": False, "checks": [], "not_ready": "frontend failed"}
    assert time.monotonic() - t0 < 5


@pytest.mark.integration
def test_a_local_launch_whose_component_fails_ends_the_run_and_says_why_in_one_place(tmp_path):
    """A frontend that cannot read its tokenizer: the launch says which component failed and why, stops the
    run's other processes (a failed component ends a Slurm job too), its smoke job ends by itself (no
    KeyboardInterrupt traceback), and hpc status says the launch gave up."""
    import os
    import subprocess
    import sys

    from hpc.launch.local import alive, local_pids
    from hpc.rundir import RunDir

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("not json")
    env = {**os.environ, "HPC_RUNS_DIR": str(tmp_path / "runs")}
    done = subprocess.run([sys.executable, "-m", "hpc", "launch", "-r", "tiny-agg", "--set", "model.generate=null",
                           "--set", f"model.path={model}"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"not ready: frontend failed while waiting for frontend up: ValueError: {model}/tokenizer.json cannot be " \
           "read as a fast tokenizer" in done.stderr
    assert "the run's other processes were stopped" in done.stderr and "KeyboardInterrupt" not in done.stderr
    (path,) = (tmp_path / "runs").iterdir()
    run = RunDir(path)
    pids = [pid for group in local_pids(run).values() for pid in group]
    assert len(pids) == 4 and not any(alive(pid) for pid in pids)  # etcd, NATS, frontend, worker
    status = subprocess.run([sys.executable, "-m", "hpc", "status", str(path)], capture_output=True, text=True,
                            timeout=60, env=env)
    assert "state: STOPPED" in status.stdout and "the launch gave up: frontend failed" in status.stdout
