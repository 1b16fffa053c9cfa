"""Run the smoke checks as a submitit job on the run's own cluster (local executor on the local profile)."""

from __future__ import annotations

import os
from typing import Any

from hpc.rundir import RunDir
from hpc.spec.cluster import time_to_minutes


def submit_smoke(run: RunDir, timeout_s: float | None = None) -> dict[str, Any]:
    import submitit

    from hpc.runtime.smoke import run_smoke

    m = run.manifest()
    folder = run.path / "smoke"
    minutes = max(2, int((timeout_s or m.recipe.smoke.timeout_s) // 60) + 2)
    if m.cluster.is_local:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=minutes)
    else:
        if m.cluster.slurm_conf:
            os.environ.setdefault("SLURM_CONF", m.cluster.slurm_conf)  # submitit runs sbatch/sacct itself
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        params: dict[str, Any] = {"timeout_min": min(minutes, time_to_minutes(m.cluster.time_limit)),
                                  "nodes": 1, "tasks_per_node": 1, "slurm_job_name": f"{m.job_name}-smoke"}
        if m.cluster.partition:
            params["slurm_partition"] = m.cluster.partition
        if m.cluster.account:
            params["slurm_account"] = m.cluster.account
        executor.update_parameters(**params)
    job = executor.submit(run_smoke, str(run.manifest_path))
    run.update_run_info(smoke_job_id=str(job.job_id))
    return job.result()
