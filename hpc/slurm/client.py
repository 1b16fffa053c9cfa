"""Slurm verbs (submit, status, cancel) over the Runner; parsing stays in parse.py."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dataclasses import replace

from hpc.slurm.parse import SACCT_FIELDS, SQUEUE_FORMAT, JobState, parse_sacct, parse_sbatch, parse_squeue
from hpc.slurm.runner import Runner
from hpc.waiting import Backoff, wait_until


class SubmitError(Exception):
    """sbatch refused the job; the message is Slurm's own."""


class SlurmClient:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def ping(self) -> str | None:
        """None when the controller answers, else what scontrol said."""
        result = self.runner.run(["scontrol", "ping"], timeout=30)
        if result.returncode == 0 and "DOWN" not in result.stdout:
            return None
        return (result.stdout.strip().splitlines() or [result.complaint])[0]

    def submit(self, script: Path) -> str:
        result = self.runner.run(["sbatch", "--parsable", str(script)], cwd=str(script.parent))
        if result.returncode != 0:
            raise SubmitError((result.stderr or result.stdout).strip() or f"sbatch exited {result.returncode}")
        return parse_sbatch(result.stdout)

    def status(self, job_id: str) -> JobState | None:
        return self.statuses([job_id])[job_id]

    def statuses(self, job_ids: list[str]) -> dict[str, JobState | None]:
        """Every job in one squeue and one sacct call (torchx/submitit style: one query, one state table):
        squeue while a job is known to the controller, sacct for steps and after it ends."""
        ids = ",".join(job_ids)
        queued = self.runner.run(["squeue", "-h", "-j", ids, "-o", SQUEUE_FORMAT])
        acct = self.runner.run(["sacct", "-n", "-P", "-j", ids, "-o", SACCT_FIELDS])
        states: dict[str, JobState | None] = {}
        for job_id in job_ids:
            live = parse_squeue(queued.stdout, job_id) if queued.returncode == 0 else None
            record = parse_sacct(acct.stdout, job_id) if acct.returncode == 0 else None
            if live is not None and not live.finished:
                steps = record.steps if record else []
                states[job_id] = replace(live, steps=steps)
            else:
                states[job_id] = record or live
        return states

    def steps(self, job_id: str) -> list[tuple[str, str, str]]:
        """The job's running steps as (step id, name, start time): squeue -s, without its batch and extern steps."""
        result = self.runner.run(["squeue", "-s", "-h", "-j", job_id, "-o", "%i|%j|%S"])
        found = []
        for line in result.stdout.splitlines() if result.returncode == 0 else []:
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0].split(".")[-1].isdigit():
                found.append((parts[0], parts[1], parts[2]))
        return found

    def cancel(self, job_id: str, grace_s: float = 10.0, poll_s: float = 0.2,
               drained: Callable[[], bool] = lambda: True) -> JobState | None:
        """Tiered, by job id only: USR1 asks every step to drain (leave routing, finish in-flight work);
        once `drained()` or after the grace period, scancel sends TERM and, KillWait later, KILL."""
        steady = Backoff(first_s=poll_s, factor=1.0, cap_s=poll_s)
        state = self.status(job_id)
        if state is not None and state.state == "RUNNING":
            self.runner.run(["scancel", "--signal=USR1", job_id])
            try:
                wait_until(drained, grace_s, f"job {job_id} draining", steady)
            except TimeoutError:
                pass  # the grace period is over: TERM now
        self.runner.run(["scancel", job_id])
        ended: list[JobState | None] = [None]

        def finished() -> bool:
            ended[0] = self.status(job_id)
            return ended[0] is None or ended[0].finished

        try:
            wait_until(finished, 30, f"job {job_id} ending", steady)
        except TimeoutError:
            pass  # report the state it is still in
        return ended[0]
