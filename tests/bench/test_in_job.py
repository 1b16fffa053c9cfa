"""hpc bench --in-job's relay of the job's output and its end, with a small fake of a submitit job."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from submitit.core.utils import UncompletedJobError

from hpc.bench import in_job

pytestmark = pytest.mark.unit


class FakeJob:
    """Writes its logs a piece per look, as a running job would; then ends as told."""

    def __init__(self, folder: Path, pieces: list[bytes], outcome) -> None:
        self.job_id = "77"
        self.paths = SimpleNamespace(stdout=folder / "77_0_log.out", stderr=folder / "77_0_log.err")
        self.pieces, self.outcome, self.cancelled = list(pieces), outcome, False

    def done(self) -> bool:
        if self.pieces:
            with self.paths.stdout.open("ab") as f:
                f.write(self.pieces.pop(0))
        return not self.pieces

    def result(self):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def cancel(self, check: bool = True) -> None:
        self.cancelled = True


def test_the_relay_passes_whole_lines_and_leaves_out_submitits_own(tmp_path):
    job = FakeJob(tmp_path, [b"submitit INFO (x) - Starting\n conc  in\n    2  1", b"6 ok\n", b"tail"], 0)
    out = io.StringIO()
    in_job._relay(job, [(job.paths.stdout, out), (job.paths.stderr, io.StringIO())], poll_s=0)
    assert out.getvalue() == " conc  in\n    2  16 ok\ntail"  # a line cut mid-write waited for its end


def test_a_job_that_did_not_finish_is_one_line_with_its_logs(tmp_path, monkeypatch, capsys):
    ended = UncompletedJobError("Job 77 (task: 0) with path x\nhas not produced any output")
    job = FakeJob(tmp_path, [b"c=1\n"], ended)
    monkeypatch.setattr("hpc.launch.backends.of_run", lambda run: SimpleNamespace(
        executor=lambda run, what, minutes: SimpleNamespace(submit=lambda fn, args: job)))
    run = SimpleNamespace(path=tmp_path, manifest=lambda: SimpleNamespace(
        cluster=SimpleNamespace(name="eos", time_limit="01:00:00")))
    args = argparse.Namespace(in_job=True, run="77", out=None)
    assert in_job.bench_in_job(args, run, lambda args: 0) == 1
    err = capsys.readouterr().err
    assert err.startswith("the load generator's job 77 did not finish: Job 77 (task: 0) with path x; its logs: ")
    assert "Traceback" not in err
