"""The job's first step, run by the preflight once its checks passed (hpc.checks.preflight: on the batch node of
a job without containers, on the first task of a container job's preflight step), before any service starts.

The job records itself in job.json (its id, when it started, who submitted it), so `hpc status`, `logs` and
`cancel` find a job that was submitted with a plain `sbatch job.sbatch` (after `hpc launch --dry-run`, or again
after a cancel) as they find one `hpc launch` submitted. run.json stays the launcher's: two writers on two
machines would lose each other's fields. What an earlier job of the same run directory left (component states,
endpoints, readiness, smoke verdict, its job.json) moves under previous/: readiness would otherwise read an
endpoint nobody listens on any more, or a failure that is not this job's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hpc.rundir import RunDir, RunInfo, write_json

# what a job writes into its run directory as it runs (logs are rewritten by each step's srun --output)
LEFT_BY_A_JOB = ("state", "endpoints", "smoke.json", "job.json")


def start(run: RunDir, job_id: str | None, now: float | None = None) -> Path | None:
    """Record this job in job.json; move what an earlier job left under previous/. Returns where it went."""
    now = time.time() if now is None else now
    earlier_job = run.job_id() or "job"
    earlier = [run.path / name for name in LEFT_BY_A_JOB if _has_content(run.path / name)]
    moved_to = None
    if earlier:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        moved_to = run.path / "previous" / f"{earlier_job}-{stamp}"
        moved_to.mkdir(parents=True, exist_ok=True)
        for path in earlier:
            path.rename(moved_to / path.name)
    record: dict = {"started_at": now, "submitted_by": _submitted_by(run.run_info(), job_id)}
    if job_id:
        record["job_id"] = job_id
    write_json(run.job_path, record)
    return moved_to


def _submitted_by(launched: RunInfo, job_id: str | None) -> str:
    """hpc launch writes run.json's smoke choice before it calls sbatch and the job id once sbatch returned, which
    may be after this job started: a run.json with the choice and no id (nor a failed submission) is launch's."""
    if launched.job_id is not None:
        return "hpc launch" if launched.job_id == job_id else "sbatch"
    return "hpc launch" if launched.smoke_via is not None and launched.submit_error is None else "sbatch"


def _has_content(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def start_job(manifest_path: str) -> str:
    """This job (SLURM_JOB_ID) starts in the run directory of `manifest_path`; what it did, in one line."""
    run = RunDir(Path(manifest_path).resolve().parent)
    job_id = os.environ.get("SLURM_JOB_ID")
    moved = start(run, job_id)
    return (f"hpc: job {job_id or '(no SLURM_JOB_ID)'} serves {run.path}"
            + (f"; an earlier job's states and endpoints moved to {moved}" if moved else ""))
