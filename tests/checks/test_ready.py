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
    write_json(run.state / "decode-0.json", {"phase": "failed", "error": "boom"})
    run.log_path("decode-0").write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")
    with pytest.raises(NotReady) as err:
        wait_ready(run.manifest(), timeout=30, progress=lambda s: None)
    assert "decode-0 failed" in str(err.value) and "CUDA out of memory" in str(err.value)


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
