"""Tests against the real dev cluster; skipped unless `hpc dev-cluster up` has run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from hpc.slurm.runner import LocalRunner
from hpc.spec.catalog import project_root

DEV = yaml.safe_load((project_root() / "clusters" / "dev.yaml").read_text())
SLURM_CONF = DEV["slurm_conf"]


def cluster_up() -> bool:
    if not Path(SLURM_CONF).is_file():
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%D %T"], env={**os.environ, "SLURM_CONF": SLURM_CONF},
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and sum(int(line.split()[0]) for line in out.stdout.splitlines() if line) >= 3


def pytest_collection_modifyitems(config, items):
    if cluster_up():
        return
    skip = pytest.mark.skip(reason="dev cluster is not up (hpc dev-cluster up)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def slurm_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", SLURM_CONF)
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    return LocalRunner({"SLURM_CONF": SLURM_CONF})


def dev_cluster_file(tmp_path: Path, **changes) -> str:
    """A copy of clusters/dev.yaml with some fields changed, as a YAML path."""
    data = {**DEV, **changes}
    path = tmp_path / f"dev-{abs(hash(str(sorted(changes.items()))))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def frontend_port() -> str:
    """A frontend port for one test's job: never the recipes' 8000, which a job left over from an earlier
    (failed) run may still hold on node1; outside every profile's job port range; below the kernel's ephemeral
    ports (32768-60999), where a connection's own end (to etcd, NATS, a worker) may hold it already."""
    import random

    return f"frontend.port={random.randint(22000, 32000)}"
