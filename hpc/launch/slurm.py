"""Submission to Slurm and the follow-up (readiness via the run directory, smoke through submitit)."""

from __future__ import annotations

import math
import sys
import time

from hpc.rundir import RunDir, bad_nodes_text, read_json
from hpc.slurm.client import SlurmClient, SubmitError
from hpc.slurm.runner import LocalRunner, Runner
from hpc.waiting import SLURM, Backoff, Throttle, wait_until


def runner_for(run: RunDir) -> Runner:
    return runner_for_conf(run.manifest().cluster.slurm_conf)


def runner_for_conf(slurm_conf: str | None) -> Runner:
    """Slurm's commands as this machine runs them, for the cluster whose profile names this SLURM_CONF."""
    return LocalRunner({"SLURM_CONF": slurm_conf} if slurm_conf else None)


def launch_slurm(run: RunDir, wait: bool = True, smoke: bool = True, runner: Runner | None = None) -> int:
    from hpc.launch.follow import follow_up
    client = SlurmClient(runner or runner_for(run))
    # hpc launch runs the smoke checks through submitit; the script's own smoke stage then stands aside.
    run.update_run_info(smoke_via="none" if not smoke else "submitit" if wait else "job")
    t0 = time.monotonic()
    try:
        job_id = client.submit(run.script_path)
    except SubmitError as exc:
        run.update_run_info(submitted=False, submit_error=str(exc))
        print(f"sbatch failed: {exc}", file=sys.stderr)
        print(f"nothing was submitted; the run directory is kept: {run.path}", file=sys.stderr)
        return 1
    run.update_run_info(submitted=True, scheduler="slurm", job_id=job_id, submitted_at=time.time())
    print(f"submitted job {job_id}")
    if wait:
        state = _wait_running(client, job_id, run)
        if state is not None:
            return state
        job_id = str(run.run_info().get("job_id", job_id))  # a resubmission's (resubmission below)
    throttle = Throttle(SLURM)

    def job_ended() -> str | None:
        nonlocal job_id
        if not throttle.due():  # readiness files are read fast; the controller is asked on a backoff
            return None
        st = client.status(job_id)
        if st is None or not st.finished:
            return None
        following = resubmission(run, job_id)
        if following is None:
            return f"job {job_id} ended {st.state}"
        job_id = following  # its preflight left bad nodes out and resubmitted it: readiness is that job's now
        return None

    return follow_up(run, t0, wait=wait, smoke=smoke, abort=job_ended)


def resubmission(run: RunDir, job_id: str) -> str | None:
    """The job that `job_id`'s preflight resubmitted without its bad nodes (preflight.on_bad_node: exclude), said
    once and recorded in run.json; None if it did not."""
    again = run.resubmitted()
    if again.get("from_job") != job_id or not again.get("job_id"):
        return None
    why = bad_nodes_text(run.preflight(job_id).get("bad_nodes", {}))
    print(f"  job {job_id}'s preflight left out {again.get('excluded')} ({why or 'see hpc logs'}); it resubmitted "
          f"itself as job {again['job_id']} on the other nodes (preflight.on_bad_node: exclude)", flush=True)
    run.update_run_info(job_id=str(again["job_id"]), resubmitted_from=job_id)
    return str(again["job_id"])


class _JobStart:
    """One look at a submitted job: RUNNING (or already reporting readiness), ended, or neither yet. Slurm is
    asked on a backoff (PENDING -> RUNNING is worth seeing soon), the run directory on every look."""

    def __init__(self, client: SlurmClient, job_id: str, run: RunDir) -> None:
        self.client, self.job_id, self.run = client, job_id, run
        self.throttle = Throttle(Backoff(first_s=0.5, factor=2.0, cap_s=8.0))
        self.status = None
        self.printed = None

    def __call__(self) -> str | None:
        if self.throttle.due():
            self.status = self.client.status(self.job_id)
        st = self.status
        # a new state or reason, or the first expected start the scheduler gives a queued job
        seen = None if st is None else (st.state, st.reason, bool(st.expected_start))
        if st is not None and seen != self.printed:
            print(f"  slurm: {st.state}{' (' + st.reason + ')' if st.reason else ''}"
                  f"{', expected to start ' + st.expected_start if st.expected_start else ''}", flush=True)
            self.printed = seen
        if st is not None and st.finished:
            return "ended"
        if read_json(self.run.state / "ready.json") is not None or (st is not None and st.state == "RUNNING"):
            return "running"
        return None


def _wait_running(client: SlurmClient, job_id: str, run: RunDir) -> int | None:
    """Until the in-job readiness stage reports, watching that the job did not end first; a PENDING job is
    waited for as long as it stays queued (Ctrl-C leaves it queued)."""
    start = _JobStart(client, job_id, run)
    outcome = wait_until(start, math.inf, f"job {job_id} to start", backoff=Backoff(first_s=0.2, factor=1.0, cap_s=0.2))
    if outcome == "running":
        return None
    from hpc.launch.follow import preflight_failure, unseen_run_dir

    failed = preflight_failure(run)
    unseen = unseen_run_dir(run, start.status.state)
    following = resubmission(run, job_id)
    if following is not None:
        return _wait_running(client, following, run)
    if failed:
        print(f"preflight failed: {failed}", file=sys.stderr)
    elif unseen:
        print(unseen, file=sys.stderr)
    print(f"job {job_id} ended {start.status.state} before it was ready" +
          ("" if unseen else f"; see: hpc logs {job_id}"), file=sys.stderr)
    return 1
