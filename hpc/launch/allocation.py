"""Inside an allocation the user holds already (salloc, or any shell with SLURM_JOB_ID): the run's own sbatch
script runs here with bash instead of through sbatch, so its srun steps are steps of that allocation. Teams that
keep nodes for a day run one service after another in them; the allocation's #SBATCH lines do not apply (its
nodes, GPUs and time limit are what salloc asked for).

hpc cancel ends the run's steps (drain first, as for a job: USR1, then TERM) and the script, never the
allocation: the steps are found by name among the allocation's, started after the run did.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from hpc.errors import UserError
from hpc.launch.backend import Cancelled
from hpc.launch.slurm import SlurmBackend, check_slurm_reachable, runner_for
from hpc.rundir import RunDir, read_json
from hpc.slurm.client import SlurmClient
from hpc.slurm.runner import Runner
from hpc.waiting import Backoff, wait_until


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: int
    nodelist: str


def current_allocation(nodes_needed: int) -> Allocation:
    """This shell's allocation, checked against the plan's node count before anything is written."""
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job_id:
        raise UserError("this shell holds no Slurm allocation (no SLURM_JOB_ID)",
                        field="--in-allocation",
                        hint=f"run it inside one: salloc -N {nodes_needed} (with the GPUs the profile asks for), "
                             "or launch without --in-allocation to submit a job")
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 0)
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    if not nodelist or nodes < 1:
        raise UserError(f"allocation {job_id} does not say its nodes (SLURM_JOB_NODELIST, "
                        "SLURM_JOB_NUM_NODES)", field="--in-allocation", hint="run hpc launch in salloc's shell")
    if nodes < nodes_needed:
        raise UserError(f"allocation {job_id} has {nodes} node(s); the plan needs {nodes_needed}",
                        field="--in-allocation", hint=f"salloc -N {nodes_needed}, or a recipe that fits")
    return Allocation(job_id=job_id, nodes=nodes, nodelist=nodelist)


def launch_in_allocation(backend: "AllocationBackend", run: RunDir, allocation: Allocation, wait: bool,
                         smoke: bool) -> int:
    from hpc.launch.follow import follow_up

    t0 = time.monotonic()
    # the job's own smoke stage: a submitit job would queue for nodes the allocation holds already
    run.update_run_info(smoke_via="job" if smoke else "none")
    run.logs.mkdir(parents=True, exist_ok=True)
    with open(run.logs / "job.out", "ab") as log:
        script = subprocess.Popen(["bash", str(run.script_path)], cwd=run.path, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    run.update_run_info(submitted=True, scheduler="slurm", job_id=allocation.job_id, in_allocation=True,
                        script_pid=script.pid, submitted_at=time.time())
    print(f"running in allocation {allocation.job_id} ({allocation.nodelist}), script pid {script.pid}")

    def script_ended() -> str | None:
        code = script.poll()
        return None if code is None else f"the run's script ended (exit {code}); see {run.logs / 'job.out'}"

    code = follow_up(run, t0, backend, wait=wait, smoke=False, abort=script_ended)
    if code != 0 or not wait or not smoke or not run.manifest().recipe.smoke.enabled:
        return code
    return _smoke_verdict(run, script_ended)


def _smoke_verdict(run: RunDir, script_ended: Callable[[], str | None]) -> int:
    """The script's own smoke stage writes smoke.json; its verdict, as a submitted job's."""
    from hpc.checks.smoke import print_verdict

    limit = run.manifest().recipe.smoke.timeout_s + 60

    def verdict_or_end() -> dict[str, Any] | None:  # {}: the script ended without one
        verdict = read_json(run.layout.smoke)
        return verdict if verdict else ({} if script_ended() else None)

    try:
        verdict = wait_until(verdict_or_end, limit, "the smoke verdict", Backoff(first_s=0.2, factor=1.5, cap_s=2.0))
    except TimeoutError:
        print(f"no smoke verdict in {limit} s; see hpc logs {run.path.name} --component job", file=sys.stderr)
        return 1
    if not verdict:
        print(f"the run's script ended before its smoke verdict: {script_ended()}", file=sys.stderr)
        return 1
    print_verdict(verdict)
    return 0 if verdict["passed"] else 1


def script_alive(run: RunDir) -> bool:
    from hpc.launch.local import alive

    pid = run.run_info().script_pid
    return isinstance(pid, int) and alive(pid)


def run_steps(client: SlurmClient, run: RunDir) -> list[str]:
    """The allocation's steps that are this run's: named as its steps are, started once it was launched."""
    m = run.manifest()
    names = {s.name for s in m.plan.services} | {w.name for w in m.plan.workers} | {"preflight", "ready", "smoke"}
    since = dt.datetime.fromtimestamp((run.run_info().submitted_at or 0.0) - 1)
    found = []
    for step_id, name, start in client.steps(str(run.job_id())):
        try:
            started = dt.datetime.fromisoformat(start)
        except ValueError:
            continue
        if name in names and started >= since:
            found.append(step_id)
    return found


def cancel_in_allocation(run: RunDir, runner: Runner, grace_s: float, drained: Callable[[], bool]) -> list[str]:
    """Drain (USR1 to the run's steps), then TERM the steps and the script; the steps still there after 30 s."""
    client = SlurmClient(runner)
    steps = run_steps(client, run)
    for step in steps:
        runner.run(["scancel", "--signal=USR1", step])
    if steps:
        try:
            wait_until(drained, grace_s, "the run's workers draining", Backoff(first_s=0.2, factor=1.0, cap_s=0.2))
        except TimeoutError:
            pass
    pid = run.run_info().script_pid
    if isinstance(pid, int) and script_alive(run):
        try:
            os.killpg(pid, signal.SIGTERM)  # the script and its srun clients: nothing new starts
        except (ProcessLookupError, PermissionError):
            pass
    def gone() -> bool:
        left = run_steps(client, run)
        for step in left:  # again while any is left: a restart loop of the script may have started one since
            runner.run(["scancel", step])
        return not left and not script_alive(run)
    try:
        wait_until(gone, 30, "the run's steps ending", Backoff(first_s=0.5, factor=1.5, cap_s=3.0))
    except TimeoutError:
        pass
    return run_steps(client, run)


class AllocationBackend(SlurmBackend):
    """An allocation this shell holds (salloc): the run's script runs here with bash, its steps are the
    allocation's; cancel ends the run's steps and script, never the allocation."""

    name = "allocation"

    def __init__(self, runner: Runner | None = None) -> None:
        super().__init__(runner)
        self.allocation: Allocation | None = None

    def check(self, r) -> None:
        if r.cluster.is_local:
            raise UserError("--in-allocation runs in a Slurm allocation; this cluster profile has no Slurm",
                            file=r.cluster_file, field="scheduler", hint="use a Slurm cluster profile")
        if r.recipe.placement == "hetjob":
            raise UserError("--in-allocation runs in one allocation; placement: hetjob asks Slurm for a "
                            "heterogeneous job of its own", file=r.recipe_file, field="placement",
                            hint="--set placement=spread, or launch without --in-allocation")
        self.allocation = current_allocation(r.plan.job_nodes)
        check_slurm_reachable(r)

    def submit(self, run: RunDir, *, wait: bool, smoke: bool) -> int:
        assert self.allocation is not None, "check() finds the allocation first"
        return launch_in_allocation(self, run, self.allocation, wait, smoke)

    def _state(self, run: RunDir, job_state: str) -> str:
        # the allocation's state is not the run's: its script's is
        return f"{'RUNNING' if script_alive(run) else 'ENDED'} in allocation {run.job_id()} ({job_state})"

    def cancel(self, run: RunDir, grace_s: float, drained: Callable[[], bool]) -> Cancelled:
        job_id = run.job_id()
        left = cancel_in_allocation(run, self.runner or runner_for(run), grace_s, drained)
        return Cancelled(line=f"run {run.path.name}: " + (f"steps still running in allocation {job_id}: "
                                                            f"{', '.join(left)}" if left
                                                            else f"its steps ended; allocation {job_id} goes on"),
                         left=left, stopped=not left)

    def serves_until(self, run: RunDir) -> str | None:
        return f"until hpc cancel, or the end of allocation {run.run_info().job_id}"

