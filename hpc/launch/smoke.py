"""Run the smoke checks as a submitit job on the run's own cluster (local executor on the local profile).

`hpc launch` starts the smoke job right after submission, so its scheduling and Python start-up overlap the
workers' loading; the job itself waits for the run to report ready, then checks.
"""

from __future__ import annotations

import math
import os
from typing import Any

from hpc.rundir import RunDir
from hpc.spec.cluster import time_to_minutes
from hpc.waiting import Backoff, wait_until


def executor_for(run: RunDir, what: str, minutes: int):
    """A submitit executor for a one-node helper job of this run (its smoke checks, its load generator) on the
    run's own cluster, its files under RUN/<what>; the local profile runs it as a process here."""
    import submitit

    m = run.manifest()
    folder = run.path / what
    if m.cluster.is_local:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=minutes)
        return executor
    if m.cluster.slurm_conf:
        os.environ.setdefault("SLURM_CONF", m.cluster.slurm_conf)  # submitit runs sbatch/sacct itself
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params: dict[str, Any] = {"timeout_min": min(minutes, time_to_minutes(m.cluster.time_limit)),
                              "nodes": 1, "tasks_per_node": 1, "slurm_job_name": f"{m.job_name}-{what}"}
    if m.cluster.partition:
        params["slurm_partition"] = m.cluster.partition
    if m.cluster.account:
        params["slurm_account"] = m.cluster.account
    executor.update_parameters(**params)
    return executor


def start_smoke(run: RunDir, wait_ready_s: float | None = None):
    from hpc.checks.smoke import run_smoke_when_ready

    budget = (wait_ready_s or 0) + run.manifest().recipe.smoke.timeout_s
    executor = executor_for(run, "smoke", minutes=max(2, int(budget // 60) + 2))
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


def submit_smoke(run: RunDir) -> dict[str, Any]:
    return finish_smoke(start_smoke(run), verdict_limit(run))
