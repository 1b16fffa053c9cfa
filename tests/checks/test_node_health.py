"""The hardware and fabric preflight's checks on this machine: GPUs through a fake nvidia-smi (tests/fakes), the
model's read, scratch space, and nodes meeting through the run directory on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from hpc.checks import node_health
from hpc.checks.node_health import (Mesh, bad_nodes, gpu_findings, kv_sources, model_read_finding,
                                     scratch_findings)

pytestmark = pytest.mark.unit

FAKE_SMI = Path(__file__).resolve().parents[1] / "fakes" / "nvidia_smi"


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """The fake nvidia-smi on PATH; returns a setter for this host's faults."""
    monkeypatch.setenv("PATH", f"{FAKE_SMI}:/usr/bin:/bin")
    for name in ("SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(name, raising=False)
    faults = tmp_path / "faults.json"
    monkeypatch.setenv("FAKE_NVIDIA_SMI", str(faults))

    def set_faults(**fault):
        faults.write_text(json.dumps({socket.gethostname(): fault}))
    set_faults()
    return set_faults


def _one(findings):
    (finding,) = findings
    return finding


def test_healthy_gpus_pass_with_their_count(smi):
    finding = _one(gpu_findings(2, "n1", 1024))
    assert finding.ok and finding.figure == "2 GPUs free, no ECC errors"


def test_fewer_gpus_than_planned_name_the_count_and_the_fix(smi):
    smi(gpus=1)
    finding = _one(gpu_findings(2, "n1", 1024))
    assert not finding.ok and finding.line() == (
        "gpus: 1 visible, the plan puts 2 on this node; drain n1 (scontrol update NodeName=n1 State=DRAIN "
        "Reason=hpc-preflight) or set preflight.on_bad_node: exclude in the cluster profile")


def test_ecc_errors_pending_retirement_and_a_stale_process_are_each_named(smi):
    smi(ecc=3, pending=True, used_mib=30000, gpu=1)
    found = gpu_findings(2, "n1", 1024)
    assert [f.figure for f in found] == [
        "GPU 1 reports 3 uncorrected ECC errors", "GPU 1 has retired pages pending (it needs a reset)",
        "GPU 1 holds 30000 MiB of 81559 before any server started (a stale process)"]
    assert "nvidia-smi --query-compute-apps" in found[2].fix and not any(f.ok for f in found)


def test_only_the_jobs_gpus_are_judged(smi, monkeypatch):
    smi(used_mib=30000, gpu=1)  # another job's GPU on a shared node
    monkeypatch.setenv("SLURM_JOB_GPUS", "0")
    assert _one(gpu_findings(1, "n1", 1024)).ok
    monkeypatch.setenv("SLURM_JOB_GPUS", "1")
    assert not _one(gpu_findings(1, "n1", 1024)).ok


def test_a_wedged_or_failing_nvidia_smi_is_bounded_and_named(smi, monkeypatch):
    smi(hang=30)
    monkeypatch.setattr(node_health, "SMI_TIMEOUT_S", 0.5)
    assert _one(gpu_findings(1, "n1", 1024)).figure == "nvidia-smi did not answer in 0 s (a wedged GPU or driver)"
    smi(exit=9)
    assert _one(gpu_findings(1, "n1", 1024)).figure.startswith(
        "nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't communicate")


def test_no_gpu_planned_or_no_nvidia_smi_skips(monkeypatch):
    assert gpu_findings(0, "n1", 1024) == []
    monkeypatch.setenv("PATH", "/nonexistent")
    finding = _one(gpu_findings(2, "n1", 1024))
    assert finding.ok and "skipped" in finding.figure


def _manifest(model_path: str, generate: bool = False) -> dict:
    return {"recipe": {"model": {"path": model_path, "generate": generate}}}


def test_the_models_largest_weight_file_is_read_with_its_speed(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * (3 << 20))
    (tmp_path / "small.safetensors").write_bytes(b"\0" * 10)
    finding = model_read_finding(_manifest(str(tmp_path)), "n1", read_mb=2, min_mb_s=None)
    assert finding.ok and finding.figure.startswith("model-00001.safetensors 2 MB in ") and "MB/s" in finding.figure
    slow = model_read_finding(_manifest(str(tmp_path)), "n1", read_mb=2, min_mb_s=1e12)
    assert not slow.ok and "under the profile's floor 1e+12 MB/s" in slow.figure


def test_nothing_to_read_is_no_finding(tmp_path):
    assert model_read_finding(_manifest(str(tmp_path)), "n1", 2, None) is None  # no weight files
    assert model_read_finding(_manifest(str(tmp_path / "gone")), "n1", 2, None) is None
    assert model_read_finding(_manifest("org/hub-id"), "n1", 2, None) is None
    (tmp_path / "w.safetensors").write_bytes(b"x")
    assert model_read_finding(_manifest(str(tmp_path), generate=True), "n1", 2, None) is None


def test_scratch_under_the_floor_fails(tmp_path):
    assert scratch_findings(str(tmp_path), 0.0) == []
    (finding,) = scratch_findings(str(tmp_path), 1e9)[:1]
    assert not finding.ok and finding.figure.startswith(f"run directory {tmp_path} has ")


def _meshes(tmp_path, names, timeout=5.0):
    return [Mesh(tmp_path / "mesh", name, i, "127.0.0.1", len(names), 1.0, timeout) for i, name in enumerate(names)]


def _probe_all(meshes):
    results = {}

    def probe(mesh):
        results[mesh.node] = mesh.probe()
    threads = [threading.Thread(target=probe, args=(m,)) for m in meshes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_nodes_that_reach_each_other_pass(tmp_path):
    meshes = _meshes(tmp_path, ["n1", "n2", "n3"])
    for m in meshes:
        m.open()
    results = _probe_all(meshes)
    for m in meshes:
        m.close()
    assert all(f.ok and f.figure.startswith("2/2 nodes reachable") for f, _ in results.values())
    assert meshes[0].heard == {"n2", "n3"}  # the connections arrived, with the peers' names


def test_a_node_nobody_can_reach_is_named_by_each_peer(tmp_path):
    meshes = _meshes(tmp_path, ["n1", "n2", "n3"])
    for m in meshes:
        m.open()
    meshes[2].close()  # n3 published its address but nothing answers there
    results = _probe_all(meshes[:2])
    for m in meshes[:2]:
        m.close()
    finding, unreachable = results["n1"]
    assert not finding.ok and finding.figure.startswith("cannot reach n3 at 127.0.0.1:") and unreachable == ["n3"]
    assert "ip route get 127.0.0.1 on n1" in finding.fix


def test_a_node_that_never_reports_is_bounded(tmp_path):
    meshes = _meshes(tmp_path, ["n1", "n2"], timeout=0.5)
    meshes[0].open()
    finding, _ = meshes[0].probe()
    meshes[0].close()
    assert not finding.ok and finding.figure == "1 of 2 nodes did not report in 0 s"


def test_which_nodes_are_left_out():
    def rec(index, unreachable=(), local=False, line="ok"):
        return {"index": index, "unreachable": list(unreachable), "local_failed": local, "lines": [line]}
    # a node whose own check failed
    assert bad_nodes({"a": rec(0), "b": rec(1, local=True, line="gpus: 1 visible")}, 2) == {"b": "gpus: 1 visible"}
    # one node nobody reaches (and that reaches nobody): it alone
    assert bad_nodes({"a": rec(0, ["c"]), "b": rec(1, ["c"]), "c": rec(2, ["a", "b"])}, 3) == {
        "c": "cannot reach a, b"}
    # two nodes that cannot reach each other: the later one (the first holds the job's services)
    assert bad_nodes({"a": rec(0, ["b"]), "b": rec(1, ["a"]), "c": rec(2)}, 3) == {"b": "cannot reach a"}
    # all well
    assert bad_nodes({"a": rec(0), "b": rec(1)}, 2) == {}


def test_each_decode_node_takes_kv_from_the_prefill_nodes_but_not_its_own():
    plan = {"plan": {"workers": [{"role": "prefill", "nodes": [1]}, {"role": "prefill", "nodes": [2]},
                                 {"role": "decode", "nodes": [2, 3]}, {"role": "agg", "nodes": [0]}]}}
    assert kv_sources(plan, 2) == [1] and kv_sources(plan, 3) == [1, 2]
    assert kv_sources(plan, 1) == [] and kv_sources(plan, 0) == []  # not a decode node


def test_the_kv_path_moves_its_megabytes_and_names_a_sender_that_stalls(tmp_path):
    meshes = _meshes(tmp_path, ["n1", "n2", "n3"])
    for m in meshes:
        m.open()
    _probe_all(meshes)
    finding, stalled = meshes[2].fetch(meshes[2].peers, ["n1", "n2"], 8, None)
    assert finding.ok and finding.figure.startswith("8 MB from 2 prefill node(s), slowest ") and stalled == []
    floor, slow = meshes[2].fetch(meshes[2].peers, ["n1"], 8, 1e9)  # no link moves 1 PB/s
    assert not floor.ok and "under min_transfer_mb_s 1e+09" in floor.figure and slow == ["n1"]

    mute = socket.socket()  # a node whose handshake passes and whose bulk data never comes: an MTU blackhole
    mute.bind(("127.0.0.1", 0))
    mute.listen(4)
    peers = {**meshes[2].peers, "n1": {**meshes[2].peers["n1"], "port": mute.getsockname()[1]}}
    t0 = time.monotonic()
    finding, stalled = meshes[2].fetch(peers, ["n1"], 8, None)
    assert time.monotonic() - t0 < 3  # peer_timeout_s (1 s), not forever
    assert not finding.ok and finding.figure.startswith("0.0 of 8 MB from n1 (stalled after 1.0 s)")
    assert "MTU" in finding.fix and stalled == ["n1"]
    mute.close()
    for m in meshes:
        m.close()
