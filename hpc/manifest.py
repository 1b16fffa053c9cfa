"""The manifest: the one contract between the launcher and the job.

`hpc launch` writes it once into the run directory (`manifest.json`); every `python -m hpc...` step of the job reads
it, and nothing else (no environment-variable relays). It holds the validated cluster profile and recipe, the
placement plan (which node, which GPUs, which ports for each worker rank) and each role's merged engine args.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from hpc.plan.placement import Plan, WorkerPlan
from hpc.spec.cluster import ClusterProfile
from hpc.spec.recipe import Recipe

MANIFEST_NAME = "manifest.json"


class ChainLink(BaseModel):
    """This job's place in a chain of jobs that serves one service past the time limit (hpc launch --chain N):
    link `index` of `links`, in the chain directory `root` (rundir.ChainDir). The next link is queued
    `handover_s` before this job's end and takes over once its smoke checks pass."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str
    index: int
    links: int
    handover_s: int


class Manifest(BaseModel):
    """Everything a component needs, in one file: the only input of `python -m hpc.*` entry points."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = 1
    run_id: str
    run_dir: str
    created: str
    cluster: ClusterProfile
    recipe: Recipe
    plan: Plan
    engine_args: dict[str, dict[str, Any]]  # role -> merged engine args
    engine_config_files: dict[str, str | None]
    # the TensorRT-LLM versions the job was validated against (any of them passes the preflight); empty: unknown
    trtllm_versions: list[str] = []
    chain: ChainLink | None = None

    @classmethod
    def load(cls, path: str | Path) -> "Manifest":
        return cls.model_validate_json(Path(path).read_text())

    @property
    def job_name(self) -> str:
        return f"hpc-{self.recipe.name}"

    @property
    def time_limit(self) -> str:
        """The job's time limit: the recipe's, else the cluster's default."""
        return self.recipe.time_limit or self.cluster.time_limit

    def processes_started(self, w: WorkerPlan) -> int:
        """Processes hpc starts for a worker: one per rank, except a local TensorRT-LLM worker, whose LLM spawns
        its own ranks (MpiPoolSession, upstream tensorrt_llm/executor/proxy.py) from the one process we start."""
        if self.cluster.is_local and self.recipe.backend.value == "trtllm":
            return 1
        return w.tasks


def manifest_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / MANIFEST_NAME
