"""hpc launch waits for the smoke verdict within a bound: a smoke job stuck in the queue held it forever."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc.launch.smoke import finish_smoke

pytestmark = pytest.mark.unit


class StuckJob:
    """A submitit job that never runs (queued behind others for good)."""

    def __init__(self, tmp_path: Path) -> None:
        self.job_id, self.cancelled = "77", False
        self.paths = SimpleNamespace(result_pickle=tmp_path / "77_result.pkl")

    def done(self) -> bool:
        return False

    def cancel(self, check: bool = True) -> None:
        self.cancelled = True


def test_a_verdict_that_never_comes_is_a_failed_smoke_and_the_job_is_cancelled(tmp_path):
    job = StuckJob(tmp_path)
    verdict = finish_smoke(job, limit_s=0.3, poll_s=0.01)
    assert not verdict["passed"] and job.cancelled
    (check,) = verdict["checks"]
    assert "smoke job 77 gave no verdict within 0.3 s" in check["detail"] and "hpc smoke RUN" in check["detail"]
