"""Cluster profiles: where and how a job runs (clusters/*.yaml)."""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from hpc.spec.base import SingleLine, StrictModel, check_env_names

# PEP 440 as TensorRT-LLM spells its releases: 1.3.0, 1.3.0rc11, 1.2.0rc6.post3 (hpc.engine_args.trtllm_versions)
VERSION_PATTERN = r"[0-9]+\.[0-9]+\.[0-9]+(?:(?:a|b|rc)[0-9]+)?(?:\.post[0-9]+)?(?:\.dev[0-9]+)?"

_TIME = re.compile(r"^(?:(\d+)-)?(\d{1,3}):(\d{2}):(\d{2})$")


def time_to_minutes(value: str) -> int:
    """Slurm `[D-]HH:MM:SS` to whole minutes (rounded up)."""
    m = _TIME.match(value)
    if not m:
        raise ValueError(f"time must look like HH:MM:SS or D-HH:MM:SS, got {value!r}")
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    if minutes > 59 or seconds > 59:
        raise ValueError(f"time {value!r} has more than 59 minutes or seconds")
    total = days * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    if total < 1:
        raise ValueError(f"time limit {value!r} is zero, which Slurm reads as no limit at all; give at least "
                         "00:01:00")
    return total


class Scheduler(str, Enum):
    SLURM = "slurm"
    LOCAL = "local"  # no Slurm: every component is a process on this machine


class GpuRequest(str, Enum):
    GPUS_PER_NODE = "gpus-per-node"  # --gpus-per-node=N
    GRES = "gres"  # --gres=gpu:N
    NONE = "none"  # the cluster hands out whole nodes; ask for no GPUs


MOUNT_PART = re.compile(r"[^,\s\x00-\x1f\x7f]+")
MOUNT_FLAGS = re.compile(r"[A-Za-z0-9_=.+-]+")  # ro, rw, nosuid, x-create=dir, ...


class Container(StrictModel):
    """A pyxis/enroot container for every step (--container-* flags).

    The image is a stock one (TensorRT-LLM, Dynamo): it brings Python, torch, transformers and TensorRT-LLM, not
    hpc. hpc's runtime reaches it as a read-only directory mounted next to the run directory (see
    hpc/launch/bundle.py), built for the image's Python; a preflight step checks both before any server starts.
    """

    image: SingleLine = Field(min_length=1, max_length=4096)
    mounts: list[str] = Field(default_factory=list, description="src:dst[:flags], both absolute paths")
    workdir: str | None = None
    writable: bool = False
    reuse: bool = Field(
        default=True,
        description="unpack the image once per node, in the job's first step (the preflight), into a named "
                    "container (hpc-<hash of the image>) that every later step reuses (and later jobs, where "
                    "pyxis keeps containers: container_scope=global); false: each step starts from the image "
                    "itself (a multi-GB image unpacked once per step)")
    python_version: str = Field(default="3.12", pattern=r"^3\.[0-9]{1,2}$",
                                description="the image's Python (major.minor): the runtime bundle is built for it")

    @field_validator("mounts")
    @classmethod
    def _pyxis_mounts(cls, mounts: list[str]) -> list[str]:
        """pyxis takes them as one comma-separated list of SRC:DST[:FLAGS]: a comma, a missing side or a relative
        path would mount something else than written, or fail every step of the job."""
        for mount in mounts:
            parts = mount.split(":")
            if len(parts) not in (2, 3) or not all(p.startswith("/") for p in parts[:2]) or \
                    not MOUNT_PART.fullmatch(mount) or (len(parts) == 3 and not MOUNT_FLAGS.fullmatch(parts[2])):
                raise ValueError(f"mount {mount[:120]!r} is not SRC:DST[:FLAGS] with both paths absolute and no "
                                 "comma or whitespace (e.g. /lustre/models:/models:ro)")
        return mounts



class ContainerOnly(StrictModel):
    """A profile's container block alone: `hpc cluster new` checks the user's --image and --mount with it before
    it probes the cluster (errors name container.image / container.mounts, as in a profile)."""

    container: Container

class Network(StrictModel):
    """What address services bind to: an interface's address, or the node name's address."""

    interface: str | None = None
    address_family: Literal["ipv4", "ipv6"] = "ipv4"


class Preflight(StrictModel):
    """The hardware and fabric checks of the job's first step, on every node before any server
    (hpc.checks.node_health); each is skipped where it cannot apply (no nvidia-smi, no weight files)."""

    hardware: bool = Field(default=True,
        description="GPUs, their memory and ECC state, the model's read speed, scratch "
                    "space and the nodes reaching each other; false: software checks only")
    on_bad_node: Literal["fail", "exclude"] = Field(
        default="fail", description="a node failing a hardware check: end the job (fail), or resubmit it once with "
                                    "sbatch --exclude of the bad nodes (exclude)")
    gpu_memory_used_max_mib: int = Field(
        default=1024, ge=0, le=1_000_000, description="memory a GPU may hold before any server (more: a stale process)")
    model_read_mb: int = Field(default=256, ge=1, le=65536, description="how much of the largest weight file is read")
    min_read_mb_s: float | None = Field(default=None, gt=0, description="a slower read of the model fails the node")
    min_free_gb: float = Field(default=1.0, ge=0, description="free space the run directory and TMPDIR must have")
    peer_timeout_s: float = Field(default=5.0, gt=0, le=120, description="a connection from one node to another")
    transfer_mb: int = Field(
        default=16, ge=0, le=1024,
        description="MB each decode worker's node fetches from each prefill worker's node, as "
                    "KV moves (over TCP at the published addresses; 0: off): a link that "
                    "connects but drops large frames (an MTU mismatch) or crawls shows here")
    min_transfer_mb_s: float | None = Field(default=None, gt=0, description="a slower transfer fails the pair")
    gather_timeout_s: float = Field(
        default=120.0, gt=0, le=3600,
        description="how long a node waits for the others to report (their containers may "
                    "still be unpacking)")


class SecretRef(StrictModel):
    """A secret named, not written: the job reads it at start, so it is in no script or manifest."""

    from_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                 description="the submitting shell's variable of this name (sbatch exports it)")
    from_file: SingleLine | None = Field(default=None, description="a file on the shared filesystem holding the value")

    @model_validator(mode="after")
    def _exactly_one(self) -> "SecretRef":
        if (self.from_env is None) == (self.from_file is None):
            raise ValueError("give exactly one of from_env or from_file")
        return self

    def resolve(self) -> str | None:
        """The value on this machine, or None when it is not there."""
        if self.from_env is not None:
            return os.environ.get(self.from_env)
        if self.from_file is None:
            return None
        try:
            return Path(self.from_file).expanduser().read_text().strip()
        except OSError:
            return None


ClusterEnv = Annotated[dict[str, str | SecretRef], AfterValidator(check_env_names)]


class ClusterProfile(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64,
                      description="what hpc launch -c takes, a file name in clusters/ and a field of every run")
    description: str = ""
    scheduler: Scheduler = Scheduler.SLURM
    partition: SingleLine | None = None
    account: SingleLine | None = None
    qos: SingleLine | None = None
    time_limit: str = "01:00:00"
    max_time_limit: str | None = Field(default=None, description="the partition's MaxTime; the job must fit")
    nodes_available: int = Field(default=1, ge=1, le=100_000)
    gpus_per_node: int = Field(default=8, ge=0, le=64)
    cpus_per_node: int = Field(default=1, ge=1, le=100_000)
    memory: SingleLine | None = Field(default=None, description="--mem per node, e.g. 0 (all) or 480G")
    gpu_request: GpuRequest = GpuRequest.GPUS_PER_NODE
    exclusive: bool = False
    container: Container | None = None
    python_env: str | None = Field(default=None, description="a virtualenv/conda prefix to activate")
    trtllm_version: str | None = Field(
        default=None, pattern=rf"^{VERSION_PATTERN}$",
        description="the TensorRT-LLM the job's environment holds (the container image's, or python_env's), e.g. "
                    "1.3.0rc11: engine configs are checked against it and the job's preflight ends the job if the "
                    "nodes hold another; an image of known tag need not say it")
    python: str = "python3"
    mpi: str = "pmix"
    network: Network = Field(default_factory=Network)
    preflight: Preflight = Field(default_factory=Preflight)
    port_base: int = Field(default=20000, ge=1024, le=65000)
    discovery: Literal["etcd", "file"] = "etcd"
    sbatch_args: list[SingleLine] = Field(default_factory=list)
    srun_args: list[str] = Field(default_factory=list)
    env: ClusterEnv = Field(default_factory=dict, description="NAME: value, or NAME: {from_env: VAR} / "
                                                             "{from_file: PATH} for secrets")
    slurm_conf: str | None = Field(default=None, description="SLURM_CONF for clients (the dev cluster needs it)")
    runs_dir: SingleLine | None = Field(
        default=None, description="where hpc launch writes this cluster's run directories: a directory every node sees "
                                  "(Lustre, home); HPC_RUNS_DIR wins over it, ./runs is the default")

    @field_validator("runs_dir")
    @classmethod
    def _shared_path(cls, value: str | None) -> str | None:
        # the jobs write their logs there and pyxis mounts it at the same path: absolute, and no ',' or ':'
        if value is not None:
            if not Path(value).expanduser().is_absolute():
                raise ValueError(f"{value!r} is relative; give an absolute path that every node mounts")
            if any(ch in value for ch in ",:"):
                raise ValueError(f"{value!r} contains ',' or ':', which pyxis mounts cannot carry")
        return value

    @field_validator("time_limit", "max_time_limit")
    @classmethod
    def _time_format(cls, value: str | None) -> str | None:
        if value is not None:
            time_to_minutes(value)
        return value

    @property
    def is_local(self) -> bool:
        return self.scheduler is Scheduler.LOCAL
