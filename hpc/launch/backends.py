"""The backend of a launch, or of a run already launched (from its run.json)."""

from __future__ import annotations

from hpc.launch.allocation import AllocationBackend
from hpc.launch.backend import Backend
from hpc.launch.local import LocalBackend
from hpc.launch.slurm import SlurmBackend
from hpc.rundir import RunDir


def for_launch(cluster_is_local: bool, in_allocation: bool) -> Backend:
    if in_allocation:
        return AllocationBackend()  # it refuses a local profile itself, with the profile's file and field
    return LocalBackend() if cluster_is_local else SlurmBackend()


def of_run(run: RunDir) -> Backend:
    info = run.run_info()
    if info.scheduler == "local":
        return LocalBackend()
    if info.in_allocation:
        return AllocationBackend()
    if info.scheduler == "slurm":
        return SlurmBackend()
    return LocalBackend() if run.manifest().cluster.is_local else SlurmBackend()  # not submitted yet
