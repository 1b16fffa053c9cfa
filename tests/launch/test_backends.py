"""One Backend per place a run lives; the CLI asks a run's backend, never which one it is."""

from __future__ import annotations

import pytest

from hpc import rundir
from hpc.launch.allocation import AllocationBackend
from hpc.launch.backends import for_launch, of_run
from hpc.launch.local import LocalBackend
from hpc.launch.slurm import SlurmBackend
from hpc.render.sbatch import render_sbatch
from hpc.resolve import resolve

pytestmark = pytest.mark.unit


def test_a_launch_and_a_launched_run_find_the_same_backend(tmp_path):
    local = rundir.create(resolve("local", "tiny-agg"), render_sbatch, root=tmp_path)
    job = rundir.create(resolve("dev", "tiny-agg"), render_sbatch, root=tmp_path)
    assert isinstance(for_launch(True, False), LocalBackend) and isinstance(of_run(local), LocalBackend)
    assert type(for_launch(False, False)) is SlurmBackend and type(of_run(job)) is SlurmBackend  # before sbatch
    job.update_run_info(submitted=True, scheduler="slurm", job_id="12")
    assert type(of_run(job)) is SlurmBackend
    job.update_run_info(in_allocation=True)
    assert isinstance(for_launch(False, True), AllocationBackend) and isinstance(of_run(job), AllocationBackend)
    local.update_run_info(submitted=True, scheduler="local", job_id=local.path.name)
    assert of_run(local).name == "local"


def test_each_backend_answers_every_verb_of_the_protocol():
    from hpc.launch.backend import Backend

    verbs = {name for name in vars(Backend) if not name.startswith("_")} | set(Backend.__annotations__)
    for backend in (LocalBackend(), SlurmBackend(), AllocationBackend()):
        assert {verb for verb in verbs if not hasattr(backend, verb)} == set(), type(backend).__name__


def test_a_local_runs_status_and_cancel_come_from_its_processes(tmp_path):
    run = rundir.create(resolve("local", "tiny-agg"), render_sbatch, root=tmp_path)
    run.update_run_info(submitted=True, scheduler="local", job_id=run.path.name, submitted_at=0.0)
    backend = of_run(run)
    assert backend.status(run)["state"] == "STOPPED"  # no process started
    done = backend.cancel(run, 0.1, lambda: True)
    assert done.stopped and done.left == [] and done.line == f"stopped {run.path.name}"


def test_the_allocation_backend_refuses_a_profile_without_slurm():
    from hpc.errors import UserError

    with pytest.raises(UserError, match="runs in a Slurm allocation") as caught:
        AllocationBackend().check(resolve("local", "tiny-agg"))
    assert caught.value.field == "scheduler"
