"""After a launch: Ctrl-C while waiting for readiness stops the waiting, not the run, and says how to reach it."""

from __future__ import annotations

import time

import pytest

from hpc import rundir
from hpc.launch.follow import follow_up
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
    monkeypatch.setattr("hpc.launch.smoke.start_smoke", lambda run, wait_ready_s: smoke)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("hpc.checks.ready.wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):  # main() turns it into exit 130
        follow_up(run, time.monotonic(), wait=True, smoke=True)
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
