"""The hardware and fabric preflight on the dev cluster, with faults injected where real clusters break: a node
whose GPUs are fewer than planned or report ECC errors or hold a stale process's memory (a fake nvidia-smi that
answers per node), a node whose namespace drops traffic to a peer (a blackhole route in it). Each fault is one
line naming the node within 30 s with nothing left running; with `preflight.on_bad_node: exclude` the job comes
back without the bad node and serves."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from hpc.cli.main import main
from hpc.rundir import list_runs
from hpc.slurm.client import SlurmClient
from tests.slurm.conftest import dev_cluster_file, frontend_port

pytestmark = pytest.mark.slurm
FAKE_SMI = Path(__file__).resolve().parents[1] / "fakes" / "nvidia_smi"


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """The fake nvidia-smi on every node's PATH (sbatch exports the submitting shell's); write faults by node."""
    path = tmp_path / "gpu-faults.json"
    path.write_text("{}")
    monkeypatch.setenv("PATH", f"{FAKE_SMI}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("FAKE_NVIDIA_SMI", str(path))
    return lambda by_node: path.write_text(json.dumps(by_node))


def _nothing_left(slurm_env, run) -> None:
    st = SlurmClient(slurm_env).status(run.job_id())
    assert st is not None and st.finished, st
    assert not (run.state / "etcd.json").exists() and not (run.path / "endpoints").exists()  # no server started


@pytest.mark.parametrize("fault, expected", [
    ({"gpus": 0}, "gpus: 0 visible, the plan puts 1 on this node; drain node2"),
    ({"ecc": 4}, "ecc: GPU 0 reports 4 uncorrected ECC errors; drain node2"),
    ({"used_mib": 40000}, "gpu memory: GPU 0 holds 40000 MiB of 81559 before any server started (a stale process)"),
])
def test_a_bad_gpu_is_named_in_one_line_within_30_s(slurm_env, tmp_path, capsys, faults, fault, expected):
    faults({"node2": fault})  # tiny-agg: the services on node1, the worker on node2
    t0 = time.monotonic()
    assert main(["launch", "-c", "dev", "-r", "tiny-agg", "--no-smoke", "--set", frontend_port()]) == 1
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("preflight failed: ")]
    assert line.startswith(f"preflight failed: hpc preflight on node2: {expected}"), line
    assert elapsed < 30, elapsed
    (run,) = list_runs()
    _nothing_left(slurm_env, run)
    record = run.preflight(run.job_id())
    assert sorted(record["nodes"]) == ["node1", "node2"] and list(record["bad_nodes"]) == ["node2"]


def test_a_node_that_drops_traffic_to_its_decode_peer_is_named(slurm_env, tmp_path, capsys):
    """tiny-disagg: services on node1, prefill on node2, decode on node3; node2's namespace drops what it sends
    to node3 (a blackhole route), as a wrong route or firewall does."""
    subprocess.run(["ip", "-n", "hpc-node2", "route", "add", "blackhole", "10.77.0.13/32"], check=True)
    try:
        t0 = time.monotonic()
        assert main(["launch", "-c", "dev", "-r", "tiny-disagg", "--no-smoke", "--set", frontend_port()]) == 1
        elapsed = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "-n", "hpc-node2", "route", "del", "blackhole", "10.77.0.13/32"], check=True)
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("preflight failed: ")]
    assert "peers: cannot reach node" in line and "10.77.0.1" in line, line
    assert elapsed < 30, elapsed
    (run,) = list_runs()
    _nothing_left(slurm_env, run)
    record = run.preflight(run.job_id())
    assert record["nodes"]["node2"]["unreachable"] == ["node3"] and record["nodes"]["node3"]["unreachable"] == ["node2"]
    assert record["nodes"]["node1"]["unreachable"] == []
    assert list(record["bad_nodes"]) == ["node3"]  # of a pair alone, the later node


def test_a_link_that_drops_large_frames_passes_the_hello_and_is_named_on_the_kv_path(slurm_env, capsys):
    """node2's namespace sends node3 nothing over about 1000 bytes (a token bucket whose burst no full segment
    fits: what an MTU mismatch on a switch port between them does). The handshake and the peers' hello are small and pass; the first bulk
    data, as a prefill sends its KV, never arrives, and no ICMP says why, so TCP would wait forever."""
    tc = ["tc", "-n", "hpc-node2"]
    for rule in (["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10"],
                 ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"],
                 ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit"],
                 # towards node3 only (Slurm's own traffic goes on): nothing over 1000 bytes gets through
                 ["qdisc", "add", "dev", "eth0", "parent", "1:20", "tbf", "rate", "1gbit", "burst", "1000",
                  "latency", "50ms"],
                 ["filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                  "ip", "dst", "10.77.0.13/32", "flowid", "1:20"]):
        subprocess.run([*tc, *rule], check=True, capture_output=True)
    try:
        t0 = time.monotonic()
        assert main(["launch", "-c", "dev", "-r", "tiny-disagg", "--no-smoke", "--set", frontend_port()]) == 1
        elapsed = time.monotonic() - t0
    finally:
        subprocess.run([*tc, "qdisc", "del", "dev", "eth0", "root"], check=True)
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("preflight failed: ")]
    assert line.startswith("preflight failed: hpc preflight on node3: kv path: 0.0 of 16 MB from node2 (stalled"), line
    assert "same MTU" in line
    assert elapsed < 30, elapsed
    (run,) = list_runs()
    _nothing_left(slurm_env, run)
    record = run.preflight(run.job_id())
    checks = {f["check"]: f for f in record["nodes"]["node3"]["findings"]}
    assert checks["peers"]["ok"] and not checks["kv path"]["ok"]  # the hello passed: only bulk data shows it
    assert list(record["bad_nodes"]) == ["node3"]


def test_on_bad_node_exclude_comes_back_on_the_good_nodes_and_serves(slurm_env, tmp_path, capsys, faults):
    faults({"node2": {"ecc": 1}})
    cluster = dev_cluster_file(tmp_path, preflight={"on_bad_node": "exclude"})
    assert main(["launch", "-c", cluster, "-r", "tiny-agg", "--set", frontend_port()]) == 0
    out = capsys.readouterr().out
    (run,) = list_runs()
    info = run.run_info()
    first, second = info.resubmitted_from, info.job_id
    assert f"job {first}'s preflight left out node2 (node2: ecc: GPU 0 reports 1 uncorrected ECC errors" in out
    assert "smoke: PASSED" in out or "smoke passed" in out
    client = SlurmClient(slurm_env)
    assert "node2" not in client.status(second).nodes  # node1 and node3
    assert run.job_id() == second and run.job()["job_id"] == second
    assert main(["status", run.path.name]) == 0
    status = capsys.readouterr().out
    assert f"resubmitted: job {first}'s preflight left out node2 (node2: ecc:" in status
    assert "preflight: 2 nodes in " in status and ", ok" in status
    assert main(["cancel", second]) == 0
