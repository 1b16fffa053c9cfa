"""Run the smoke checks as a submitit job on the run's own cluster (its backend's executor: local on the local
profile).

`hpc launch` starts the smoke job right after submission, so its scheduling and Python start-up overlap the
workers' loading; the job itself waits for the run to report ready, then checks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from hpc.rundir import RunDir
from hpc.waiting import Backoff, wait_until

if TYPE_CHECKING:
    from hpc.launch.backend import Backend


def start_smoke(run: RunDir, backend: "Backend", wait_ready_s: float | None = None):
    from hpc.checks.smoke import run_smoke_when_ready

    budget = (wait_ready_s or 0) + run.manifest().recipe.smoke.timeout_s
    executor = backend.executor(run, "smoke", max(2, int(budget // 60) + 2))
    job = executor.submit(run_smoke_when_ready, str(run.manifest_path), wait_ready_s or 0.0)
    run.update_run_info(smoke_job_id=str(job.job_id))
    return job


# How long a smoke job may wait in the queue beside its own smoke.timeout_s: past both, the launch stops waiting
# for its verdict (a job stuck in the queue held hpc launch forever)
QUEUE_ALLOWANCE_S = 900.0


def finish_smoke(job, limit_s: float = math.inf, poll_s: float = 0.05) -> dict[str, Any]:
    """The verdict; polls for submitit's result file itself (its own polling adds seconds). Past `limit_s`, the job
    is cancelled and the verdict says so."""
    result_file = job.paths.result_pickle
    try:
        wait_until(lambda: result_file.exists() or job.done(), limit_s, "the smoke verdict",
                   backoff=Backoff(first_s=poll_s, factor=1.0, cap_s=poll_s))
    except TimeoutError:
        job.cancel(check=False)
        return {"passed": False, "checks": [{
            "name": "verdict", "ok": False,
            "detail": f"the smoke job {job.job_id} gave no verdict within {limit_s:g} s (smoke.timeout_s and "
                      f"{QUEUE_ALLOWANCE_S:g} s in the queue) and was cancelled; hpc smoke RUN runs it again"}]}
    return job.result()


def verdict_limit(run: RunDir) -> float:
    return run.manifest().recipe.smoke.timeout_s + QUEUE_ALLOWANCE_S


def submit_smoke(run: RunDir, backend: "Backend") -> dict[str, Any]:
    return finish_smoke(start_smoke(run, backend), verdict_limit(run))
