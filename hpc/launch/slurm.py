"""Submission to Slurm and the follow-up (readiness via the run directory, smoke through submitit)."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable

from hpc.errors import UserError
from hpc.launch.backend import Cancelled
from hpc.rundir import RunDir, bad_nodes_text, read_json
from hpc.slurm.client import SlurmClient, SubmitError
from hpc.slurm.runner import LocalRunner, Runner
from hpc.waiting import SLURM, Backoff, Throttle, wait_until


def runner_for(run: RunDir) -> Runner:
    return runner_for_conf(run.manifest().cluster.slurm_conf)


def runner_for_conf(slurm_conf: str | None) -> Runner:
    """Slurm's commands as this machine runs them, for the cluster whose profile names this SLURM_CONF."""
    return LocalRunner({"SLURM_CONF": slurm_conf} if slurm_conf else None)


def launch_slurm(backend: "SlurmBackend", run: RunDir, wait: bool, smoke: bool) -> int:
    from hpc.launch.follow import follow_up

    client = backend.client(run)
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
        job_id = run.run_info().job_id or job_id  # a resubmission's (resubmission below)
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

    return follow_up(run, t0, backend, wait=wait, smoke=smoke, abort=job_ended)


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
        if read_json(self.run.layout.ready) is not None or (st is not None and st.state == "RUNNING"):
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
    ended = start.status.state if start.status is not None else "UNKNOWN"  # "ended" is said of a state seen
    unseen = unseen_run_dir(run, ended)
    following = resubmission(run, job_id)
    if following is not None:
        return _wait_running(client, following, run)
    if failed:
        print(f"preflight failed: {failed}", file=sys.stderr)
    elif unseen:
        print(unseen, file=sys.stderr)
    print(f"job {job_id} ended {ended} before it was ready" +
          ("" if unseen else f"; see: hpc logs {job_id}"), file=sys.stderr)
    return 1


class SlurmBackend:
    """A Slurm job of its own: sbatch of the run's script; Slurm's commands as this machine runs them."""

    name = "slurm"
    smoke_ends_itself = False

    def __init__(self, runner: Runner | None = None) -> None:
        self.runner = runner

    def client(self, run: RunDir) -> SlurmClient:
        return SlurmClient(self.runner or runner_for(run))

    def check(self, r) -> None:
        check_slurm_reachable(r)

    def submit(self, run: RunDir, *, wait: bool, smoke: bool) -> int:
        return launch_slurm(self, run, wait, smoke)

    def status(self, run: RunDir) -> dict[str, Any]:
        from hpc.launch.follow import timed_out, unseen_run_dir

        job_id = run.job_id()
        st = None if job_id is None else self.client(run).status(job_id)
        if st is None:
            return {"state": "UNKNOWN"}
        failing = [f"{s.step_id}:{s.name} exit {s.exit_code}" for s in st.steps
                   if s.state in ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY") or s.exit_code]
        return {"state": self._state(run, st.state), "elapsed": st.elapsed, "time_left": st.time_left,
                "nodes": st.nodes, "reason": st.reason, "expected_start": st.expected_start,
                "exit_code": st.exit_code, "failed_steps": failing,
                "why": unseen_run_dir(run, st.state) or timed_out(run.manifest(), st.state),
                "steps": [{"id": s.step_id, "name": s.name, "state": s.state, "exit_code": s.exit_code}
                          for s in st.steps]}

    def _state(self, run: RunDir, job_state: str) -> str:
        return job_state

    def cancel(self, run: RunDir, grace_s: float, drained: Callable[[], bool]) -> Cancelled:
        job_id = run.job_id()
        if job_id is None:  # nothing was ever submitted from this run directory
            return Cancelled(line="no job was submitted for this run", left=[], stopped=True)
        state = self.client(run).cancel(job_id, grace_s=grace_s, drained=drained)
        return Cancelled(line=f"job {job_id}: {state.state if state else 'gone'}", left=[],
                         stopped=state is None or state.finished)

    def end_if_failed(self, run: RunDir) -> bool:
        return False  # a Slurm job ends by its script (wait -n)

    def executor(self, run: RunDir, what: str, minutes: int):
        import submitit

        from hpc.spec.cluster import time_to_minutes

        m = run.manifest()
        if m.cluster.slurm_conf:
            os.environ.setdefault("SLURM_CONF", m.cluster.slurm_conf)  # submitit runs sbatch/sacct itself
        executor = submitit.AutoExecutor(folder=run.path / what, cluster="slurm")
        params: dict[str, Any] = {"timeout_min": min(minutes, time_to_minutes(m.cluster.time_limit)),
                                  "nodes": 1, "tasks_per_node": 1, "slurm_job_name": f"{m.job_name}-{what}"}
        if m.cluster.partition:
            params["slurm_partition"] = m.cluster.partition
        if m.cluster.account:
            params["slurm_account"] = m.cluster.account
        executor.update_parameters(**params)
        return executor

    def serves_until(self, run: RunDir) -> str | None:
        m = run.manifest()
        drain = (f"; its workers drain from {m.recipe.drain_before_end_s} s before (drain_before_end_s)"
                 if m.recipe.drain_before_end_s else "")
        return f"until the time limit {m.time_limit}{drain}"


def check_slurm_reachable(r) -> None:
    """Before writing anything: can this machine submit to the cluster at all?"""
    import shutil
    from pathlib import Path

    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on PATH: submit from a Slurm login node", file=r.cluster_file,
                        hint="or use --dry-run to write the run directory and submit it later")
    hint = "start it: hpc dev-cluster up" if r.cluster.name == "dev" else "check the cluster profile"
    if r.cluster.slurm_conf and not Path(r.cluster.slurm_conf).is_file():
        raise UserError(f"{r.cluster.slurm_conf} does not exist", file=r.cluster_file, field="slurm_conf",
                        hint=hint)
    problem = SlurmClient(runner_for_conf(r.cluster.slurm_conf)).ping()
    if problem:
        raise UserError(f"the Slurm controller does not answer ({problem})", file=r.cluster_file, hint=hint)
