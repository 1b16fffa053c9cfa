"""`hpc cluster new`: a profile from sinfo, srun and scontrol, answered here by a fake runner with outputs
recorded on the dev cluster (slurm-wlm 22.05.8) and a DGX partition's shapes."""

from __future__ import annotations

import argparse

import pytest
import yaml

from hpc.cli import cluster_command
from hpc.errors import UserError
from hpc.slurm.probe import gres_gpus, parse_mpi_list, parse_sinfo, probe, slurm_time
from hpc.slurm.runner import Completed
from hpc.spec.base import parse_model
from hpc.spec.cluster import ClusterProfile

pytestmark = pytest.mark.unit

# Recorded on the dev cluster (hpc dev-cluster up --containers).
DEV_SINFO = "debug*|3|4|gpu:2|infinite|n/a\n"
DEV_MPI = ("MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\n"
           "specific pmix plugin versions available: pmix_v4\n")
DEV_HELP = "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH\n"
DEV_CONFIG = "MpiDefault              = none\nSelectType              = select/cons_tres\n"
# A DGX partition of two node shapes (sinfo prints one line per shape).
DGX_SINFO = ("batch|560|224|gpu:h100:8(S:0-1)|4:00:00|2:00:00\n"
             "batch|16|112|gpu:h100:8(S:0-1),shard:16|4:00:00|2:00:00\n")
OLD_MPI = "srun: MPI types are...\nsrun: none\nsrun: pmi2\n"  # 22.05 on stderr, no pmix built


class FakeCluster:
    def __init__(self, sinfo: str, mpi: str = DEV_MPI, help_text: str = DEV_HELP, config: str = DEV_CONFIG):
        self.answers = {"sinfo": sinfo, "mpi": mpi, "help": help_text, "config": config}
        self.calls: list[list[str]] = []

    def run(self, argv, cwd=None, timeout=60.0):
        self.calls.append(argv)
        if argv[:2] == ["sinfo", "-h"] and "-p" in argv:
            return Completed(0, self.answers["sinfo"], "")
        if argv == ["sinfo", "-h", "-o", "%P"]:
            return Completed(0, "debug*\ngpu\n", "")
        if argv == ["srun", "--mpi=list"]:
            return Completed(0, "", self.answers["mpi"])
        if argv == ["srun", "--help"]:
            return Completed(0, self.answers["help"], "")
        if argv == ["scontrol", "show", "config"]:
            return Completed(0, self.answers["config"], "")
        raise AssertionError(f"unexpected command {argv}")


def test_parsers():
    assert [slurm_time(t) for t in ("infinite", "30:00", "4:00:00", "1-00:00:00", "2-12", "n/a")] == [
        None, "00:30:00", "04:00:00", "1-00:00:00", "2-12:00:00", None]
    assert [gres_gpus(g) for g in ("gpu:2", "gpu:h100:8(S:0-1)", "gpu:a100:4,shard:8", "(null)", "shard:4")] == [
        2, 8, 4, 0, 0]
    assert parse_mpi_list(DEV_MPI) == ["pmix", "none", "cray_shasta", "pmi2"]
    assert parse_mpi_list(OLD_MPI) == ["none", "pmi2"]
    dgx = parse_sinfo(DGX_SINFO, "batch")
    assert (dgx.nodes, dgx.cpus_per_node, dgx.gpus_per_node, dgx.max_time, dgx.node_kinds) == (
        560, 224, 8, "04:00:00", 2)
    assert parse_sinfo(DEV_SINFO, "gpu") is None


def _args(**kw) -> argparse.Namespace:
    base = {"name": "mine", "partition": "debug", "account": None, "qos": None, "image": None, "mount": [],
            "runs_dir": None, "out": None}
    return argparse.Namespace(**{**base, **kw})


def test_the_dev_clusters_profile_has_its_shape_and_validates():
    facts = probe(FakeCluster(DEV_SINFO), "debug")
    text = cluster_command.profile_text(_args(image="/images/trtllm 1.sqsh", mount=["/m:/models:ro"],
                                              runs_dir="/shared/runs"), facts)
    profile = parse_model(ClusterProfile, yaml.safe_load(text), file="new.yaml")
    assert (profile.partition, profile.nodes_available, profile.cpus_per_node, profile.gpus_per_node) == (
        "debug", 3, 4, 2)
    assert profile.gpu_request.value == "gres" and profile.mpi == "pmix" and profile.max_time_limit is None
    assert profile.time_limit == "04:00:00" and "the partition has no MaxTime" in text
    assert profile.container.image == "/images/trtllm 1.sqsh" and profile.container.mounts == ["/m:/models:ro"]
    assert profile.runs_dir == "/shared/runs"
    assert "gpu_request: gpus-per-node" in text  # offered in the comment: cons_tres


def test_a_dgx_partition_without_pmix_or_pyxis_says_so():
    facts = probe(FakeCluster(DGX_SINFO, mpi=OLD_MPI, help_text="", config="SelectType = select/cons_res\n"),
                  "batch")
    text = cluster_command.profile_text(_args(name="eos2", partition="batch", account="acct"), facts)
    profile = parse_model(ClusterProfile, yaml.safe_load(text), file="new.yaml")
    assert (profile.nodes_available, profile.gpus_per_node, profile.time_limit, profile.max_time_limit) == (
        560, 8, "04:00:00", "04:00:00")
    assert profile.mpi == "pmi2" and "ranks want pmix" in text and profile.container is None
    assert "2 node shapes, this is the most numerous" in text and "container:" not in text.replace("# container", "")


def test_user_errors_name_the_flag_and_write_nothing(tmp_path, monkeypatch):
    fake = FakeCluster(DEV_SINFO)
    monkeypatch.setattr("hpc.slurm.runner.LocalRunner", lambda env=None: fake)
    with pytest.raises(UserError, match="--partition: no partition 'nope' here .one of: debug, gpu."):
        cluster_command.new(_args(partition="nope"))
    no_pyxis = FakeCluster(DEV_SINFO, help_text="")
    monkeypatch.setattr("hpc.slurm.runner.LocalRunner", lambda env=None: no_pyxis)
    out = tmp_path / "c.yaml"
    with pytest.raises(UserError, match="--image: this cluster's srun has no --container-image"):
        cluster_command.new(_args(image="x.sqsh", out=str(out)))
    with pytest.raises(UserError, match="runs_dir: 'relative/runs' is relative"):
        cluster_command.new(_args(runs_dir="relative/runs", out=str(out)))
    assert not out.exists()
    assert cluster_command.new(_args(out=str(out))) == 0 and out.exists()
    with pytest.raises(UserError, match="--out: .* exists; hpc cluster new does not overwrite"):
        cluster_command.new(_args(out=str(out)))


class NoController(FakeCluster):
    """A machine whose Slurm has no controller to ask: sinfo's stderr as on a host without slurm.conf."""

    def run(self, argv, cwd=None, timeout=60.0):
        self.calls.append(argv)
        return Completed(1, "", "sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
                                "sinfo: error: fetch_config: DNS SRV lookup failed\n"
                                "sinfo: fatal: Could not establish a configuration source\n")


def test_a_slurm_that_does_not_answer_is_one_line_with_its_verdict(tmp_path, monkeypatch):
    fake = NoController(DEV_SINFO)
    monkeypatch.setattr("hpc.slurm.runner.LocalRunner", lambda env=None: fake)
    out = tmp_path / "c.yaml"
    with pytest.raises(UserError) as caught:
        cluster_command.new(_args(out=str(out)))
    text = caught.value.render()
    assert "\n" not in text and "sinfo: fatal: Could not establish a configuration source" in text, text
    assert len(fake.calls) == 1 and not out.exists()


@pytest.mark.parametrize("image, version", [("nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.1.1", "1.3.0rc11"),
                                            ("/images/trtllm.sqsh", None)])
def test_a_known_images_trtllm_version_is_filled_in(image, version):
    facts = probe(FakeCluster(DEV_SINFO), "debug")
    text = cluster_command.profile_text(_args(image=image), facts)
    profile = parse_model(ClusterProfile, yaml.safe_load(text), file="new.yaml")
    assert profile.trtllm_version == version
    assert version is not None or "# trtllm_version: X.Y.Z" in text  # to fill in, commented
