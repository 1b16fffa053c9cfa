"""What a Slurm cluster offers, asked from a login node: a partition's nodes, CPUs, GPUs and time limits, the MPI
plugins srun has, whether pyxis is there. Read through the Runner, parsed here (pure), for `hpc cluster new`."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from hpc.errors import UserError
from hpc.slurm.runner import Runner

SINFO_FORMAT = "%P|%D|%c|%G|%l|%L"  # partition, nodes, CPUs per node, generic resources, MaxTime, DefaultTime


@dataclass(frozen=True)
class PartitionFacts:
    partition: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    max_time: str | None  # HH:MM:SS or D-HH:MM:SS; None: no limit
    default_time: str | None
    node_kinds: int  # sinfo lines of different node shapes in the partition (the most numerous one is used)


@dataclass(frozen=True)
class ClusterFacts:
    partition: PartitionFacts
    mpi_plugins: list[str]
    pyxis: bool
    select_type: str


def slurm_time(value: str) -> str | None:
    """sinfo's time ('infinite', '30:00', '4:00:00', '1-00:00:00', '2-0') as hpc's HH:MM:SS / D-HH:MM:SS."""
    value = value.strip()
    if value.lower() in ("infinite", "unlimited", "n/a", "none", ""):
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days and len(parts) == 1:  # D-HH
        parts = [parts[0], 0, 0]
    elif len(parts) == 1:  # minutes
        parts = [0, parts[0], 0]
    elif len(parts) == 2:  # MM:SS
        parts = [0, *parts]
    hours, minutes, seconds = parts
    text = f"{hours:02d}:{minutes:02d}:{seconds:02d}"
    return f"{int(days)}-{text}" if days else text


def gres_gpus(gres: str) -> int:
    """GPUs per node from sinfo's %G: 'gpu:8', 'gpu:h100:8(S:0-1)', 'gpu:a100:4,shard:8', '(null)'."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)", gres))


def parse_sinfo(stdout: str, partition: str) -> PartitionFacts | None:
    rows = []
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 6 or parts[0].rstrip("*") != partition:
            continue
        rows.append((int(parts[1]), int(parts[2].rstrip("+")), gres_gpus(parts[3]), parts[4], parts[5]))
    if not rows:
        return None
    shapes = Counter()
    for nodes, cpus, gpus, _, _ in rows:
        shapes[(cpus, gpus)] += nodes
    (cpus, gpus), nodes = shapes.most_common(1)[0]
    return PartitionFacts(partition=partition, nodes=nodes, cpus_per_node=cpus, gpus_per_node=gpus,
                          max_time=slurm_time(rows[0][3]), default_time=slurm_time(rows[0][4]),
                          node_kinds=len(shapes))


def parse_mpi_list(text: str) -> list[str]:
    """`srun --mpi=list`: 'MPI plugin types are...\\n\\tnone\\n\\tpmix\\nspecific pmix plugin versions...'."""
    plugins = []
    for line in text.splitlines():
        word = line.strip().removeprefix("srun:").strip()
        if re.fullmatch(r"[a-z][a-z0-9_]*", word) and word not in plugins:
            plugins.append(word)
    return plugins


def config_value(text: str, key: str) -> str:
    """One key of `scontrol show config` ('SelectType              = select/cons_tres')."""
    m = re.search(rf"^{re.escape(key)}\s*=\s*(\S.*?)\s*$", text, re.M)
    return m.group(1) if m else ""


def probe(runner: Runner, partition: str) -> ClusterFacts:
    """Four read-only commands; a cluster that does not answer, or has no such partition, is one UserError."""
    sinfo = runner.run(["sinfo", "-h", "-p", partition, "-o", SINFO_FORMAT])
    if sinfo.returncode != 0:
        raise UserError(f"sinfo failed: {sinfo.complaint}", field="--partition",
                        hint="run it on a login node of the cluster, with Slurm on PATH")
    facts = parse_sinfo(sinfo.stdout, partition)
    if facts is None:
        names = runner.run(["sinfo", "-h", "-o", "%P"]).stdout.split()
        raise UserError(f"no partition {partition!r} here", field="--partition",
                        hint=f"one of: {', '.join(n.rstrip('*') for n in names) or '(sinfo lists none)'}")
    mpi = runner.run(["srun", "--mpi=list"])
    helptext = runner.run(["srun", "--help"])
    config = runner.run(["scontrol", "show", "config"])
    return ClusterFacts(partition=facts, mpi_plugins=parse_mpi_list(mpi.stdout + "\n" + mpi.stderr),
                        pyxis="--container-image" in helptext.stdout,
                        select_type=config_value(config.stdout, "SelectType"))
