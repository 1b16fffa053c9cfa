"""Readiness reports a stuck or failed stage with that component's log, instead of a silent timeout."""

from __future__ import annotations

import pytest

from hpc import rundir
from hpc.render.sbatch import render_sbatch
from hpc.resolve import resolve
from hpc.rundir import write_json
from hpc.checks.ready import NotReady, wait_ready

pytestmark = pytest.mark.unit


@pytest.fixture
def run(tmp_path):
    return rundir.create(resolve("local", "tiny-disagg"), render_sbatch, root=tmp_path)


def test_stuck_stage_names_component_and_shows_its_log(run):
    run.log_path("etcd").write_text("line 1\netcd: bind: address already in use\n")
    with pytest.raises(NotReady) as err:
        wait_ready(run.manifest(), timeout=0.3, progress=lambda s: None)
    assert "stuck waiting for etcd healthy" in str(err.value)
    assert "address already in use" in str(err.value)


def test_failed_component_is_reported_at_once(run):
    write_json(run.state / "decode-0.json", {"phase": "failed", "error": "OutOfMemoryError: CUDA out of memory"})
    run.log_path("decode-0").write_text("Traceback ...\nRuntimeError: the engine process failed\n")
    with pytest.raises(NotReady) as err:
        wait_ready(run.manifest(), timeout=30, progress=lambda s: None)
    # the error it reported first, on the verdict's line, then its log
    assert str(err.value).startswith("decode-0 failed while waiting for etcd healthy: OutOfMemoryError: CUDA out of "
                                     "memory\n  last lines of its log:\n")
    assert "RuntimeError: the engine process failed" in str(err.value)


def test_a_worker_its_policy_restarts_is_waited_for_and_one_failed_for_good_is_not(run):
    """A rank that failed while the job came up, its role's policy about to start it again (`restarting`), is
    not the job's failure: readiness waits for the new start (and here runs out of time on the stage before)."""
    write_json(run.state / "decode-0.rank1.json", {"phase": "failed", "error": "killed", "restarting": True})
    with pytest.raises(NotReady) as err:
        wait_ready(run.manifest(), timeout=0.5, progress=lambda s: None)
    assert "stuck waiting for etcd healthy" in str(err.value) and "decode-0" not in str(err.value)
    write_json(run.state / "decode-0.rank1.json", {"phase": "failed", "error": "killed", "restarting": False})
    with pytest.raises(NotReady, match="decode-0.rank1 failed"):
        wait_ready(run.manifest(), timeout=30, progress=lambda s: None)


def test_a_failed_workers_state_says_whether_its_policy_starts_it_again(tmp_path):
    from hpc.runtime.worker.entry import restarts_left

    manifest = rundir.create(resolve("local", "tiny-disagg", overrides=[
        "roles.decode.failure.on_failure=restart", "roles.decode.failure.max_restarts=2"]),
        render_sbatch, root=tmp_path).manifest()
    assert [restarts_left(manifest, "decode", 0, attempt) for attempt in range(4)] == [True, True, False, False]
    assert not restarts_left(manifest, "prefill", 0, 0)  # the recipe's default policy for prefill: fail


def test_abort_reason_stops_the_wait(run):
    with pytest.raises(NotReady, match="job 7 ended FAILED"):
        wait_ready(run.manifest(), timeout=30, progress=lambda s: None, abort=lambda: "job 7 ended FAILED")


def test_a_frontend_that_cannot_start_reports_failed(tmp_path):
    """So readiness (in the job and in hpc launch) stops at once instead of waiting out its timeout."""
    import datetime as dt
    import json
    import subprocess
    import sys

    from hpc.resolve import resolve

    run = tmp_path / "run"
    (run / "state").mkdir(parents=True)
    manifest = resolve("local", "tiny-agg", [f"model.path={tmp_path / 'no-such-model'}", "model.generate=null"]).manifest(
        run, "run", dt.datetime(2026, 1, 1))
    (run / "manifest.json").write_text(manifest.model_dump_json())
    done = subprocess.run([sys.executable, "-m", "hpc.runtime.frontend", str(run / "manifest.json")],
                          capture_output=True, text=True, timeout=60)
    state = json.loads((run / "state" / "frontend.json").read_text())
    assert done.returncode != 0 and state["phase"] == "failed" and state["error"]


def test_smoke_verdicts_hold_under_python_O():
    """`python -O` strips assert: the smoke checks use explicit failures, so a failing check still fails."""
    import subprocess
    import sys

    probe = "from hpc.checks.smoke import require\nrequire(True, 'fine')\nrequire(False, 'roles that served nothing')\n"
    done = subprocess.run([sys.executable, "-O", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "CheckFailed: roles that served nothing" in done.stderr


def test_an_endpoint_nobody_listens_on_is_waited_on_not_an_error(run):
    # an earlier job's etcd endpoint (a resubmitted run directory, before the new job's first step moves it)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once the socket is closed
    write_json(run.path / "endpoints" / "etcd.json", {"host": "127.0.0.1", "port": closed,
                                                     "health": f"http://127.0.0.1:{closed}/health"})
    with pytest.raises(NotReady, match="stuck waiting for etcd healthy"):  # not a connection error
        wait_ready(run.manifest(), timeout=0.3, progress=lambda s: None)
