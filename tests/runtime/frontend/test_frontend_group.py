"""One frontend as several processes on one port (frontend.processes): connections dealt evenly over them,
/health and /metrics answer for all of them from any, and a process that dies takes the frontend down visibly."""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from hpc.checks.probe import get_json, get_text, metric_by_label, metric_values
from hpc.launch.local import alive, local_pids
from hpc.runtime.frontend.group import merge_health, merge_metrics
from hpc.spec.recipe import FrontendSpec
from hpc.waiting import wait_until
from tests.runtime.conftest import stack_fixture


@pytest.mark.unit
def test_processes_is_a_count_or_auto_and_never_a_boolean(capsys):
    assert FrontendSpec().processes == "auto"
    assert FrontendSpec(processes=3).processes == 3
    for bad in (0, 65, True, "many", 1.5):
        with pytest.raises(ValueError):
            FrontendSpec(processes=bad)
    from hpc.cli.main import main

    assert main(["validate", "-r", "tiny-agg", "--set", "frontend.processes=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tiny-agg.yaml" in err[0] and \
        "frontend.processes: expected a count from 1 to 64 or 'auto', got 0" in err[0], err


@pytest.mark.unit
def test_metrics_of_the_processes_are_summed_except_views_of_shared_state():
    one = (b'# TYPE hpc_frontend_requests_total counter\nhpc_frontend_requests_total{run="r"} 3\n'
           b'# TYPE hpc_frontend_agg_instances gauge\nhpc_frontend_agg_instances{run="r"} 2\n'
           b'hpc_frontend_ttft_bucket{le="0.1"} 1.0\nhpc_frontend_ttft_created{m="x"} 100.0\n')
    two = (b'# TYPE hpc_frontend_requests_total counter\nhpc_frontend_requests_total{run="r"} 4\n'
           b'# TYPE hpc_frontend_agg_instances gauge\nhpc_frontend_agg_instances{run="r"} 1\n'
           b'hpc_frontend_ttft_bucket{le="0.1"} 2.0\nhpc_frontend_ttft_created{m="x"} 90.0\n'
           b'# TYPE hpc_frontend_routed_agg_1_total counter\nhpc_frontend_routed_agg_1_total{run="r"} 5\n')
    merged = merge_metrics([one, two]).decode()
    assert merged.count("# TYPE hpc_frontend_requests_total counter") == 1
    assert metric_values(merged, "hpc_frontend_requests_total") == 7
    assert metric_values(merged, "hpc_frontend_agg_instances") == 2  # the same workers, seen twice
    assert metric_values(merged, "hpc_frontend_ttft_bucket") == 3
    assert metric_values(merged, "hpc_frontend_ttft_created") == 90
    assert metric_values(merged, "hpc_frontend_routed_agg_1_total") == 5  # only one process routed there
    lines = merged.splitlines()
    assert lines.index("# TYPE hpc_frontend_routed_agg_1_total counter") + 1 == \
        lines.index('hpc_frontend_routed_agg_1_total{run="r"} 5.0')


def _view(instances: dict[str, list[tuple[str, int]]], blocks: int = 0, draining: tuple[str, ...] = ()) -> dict:
    return {"status": "x", "model": "m", "expected": {"prefill": 1, "decode": 2},
            "live": {}, "instances": {role: [{"index": i, "instance_id": iid, "routed": routed,
                                              "draining": iid in draining}
                                             for i, (iid, routed) in enumerate(items)]
                                      for role, items in instances.items()},
            "router": {"policy": "kv_aware", "stale": blocks == 0, "events": 10 + blocks, "prompt_blocks": blocks,
                       "cached_blocks": blocks // 2, "indexed_blocks": 20 + blocks, "resyncs": 1}}


@pytest.mark.unit
def test_health_of_the_group_counts_a_worker_only_when_every_process_routes_to_it():
    first = _view({"prefill": [("p0", 3)], "decode": [("d0", 1), ("d1", 2)]}, blocks=8)
    late = _view({"prefill": [("p0", 4)], "decode": [("d0", 5)]})  # has not seen d1 yet
    merged = merge_health([first, late])
    assert merged["live"] == {"prefill": 1, "decode": 1} and merged["status"] == "degraded"
    assert [(i["instance_id"], i["routed"]) for i in merged["instances"]["decode"]] == [("d0", 6)]
    assert merged["instances"]["prefill"][0]["routed"] == 7
    assert merged["router"] == {"policy": "kv_aware", "stale": True, "events": 18, "prompt_blocks": 8,
                                "cached_blocks": 4, "indexed_blocks": 20, "resyncs": 2}
    assert merged["processes"] == 2
    caught_up = _view({"prefill": [("p0", 4)], "decode": [("d0", 5), ("d1", 0)]})
    assert merge_health([first, caught_up])["status"] == "healthy"
    # a worker one process already sees draining takes no new requests from the group: listed, not live
    leaving = merge_health([first, _view({"prefill": [("p0", 4)], "decode": [("d0", 5), ("d1", 0)]},
                                         draining=("d1",))])
    assert leaving["live"] == {"prefill": 1, "decode": 1} and leaving["status"] == "degraded"
    assert [(i["instance_id"], i["draining"]) for i in leaving["instances"]["decode"]] == [("d0", False),
                                                                                           ("d1", True)]


grouped = stack_fixture("mock-agg", "--set", "frontend.processes=2")


def _frontend_processes(stack) -> list[int]:
    """The frontend's serving processes, process 0 first: its process group (the launcher's) holds every one it
    started, and their supervisor."""
    (leader,) = local_pids(stack.run)["frontend"]
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[2]) == leader and b"hpc.runtime.frontend" in argv and fields[0] != "Z":
            if b"--replica" in argv:
                found.append((int(argv[argv.index(b"--replica") + 1]), int(stat.parent.name)))
            elif b"--attempt" in argv or stack.manifest.recipe.frontend.max_restarts == 0:  # not the supervisor
                found.append((0, int(stat.parent.name)))
    return [pid for _, pid in sorted(found)]


def _completions_on_fresh_connections(url: str, model: str, n: int) -> None:
    u = urlsplit(url)
    for _ in range(n):  # a connection each: the kernel picks a process per connection
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": "hello", "max_tokens": 3}),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        response.read()
        conn.close()


def _per_process(text: str, name: str, processes: int) -> list[float]:
    counts = metric_by_label(text, name, "process")
    return [counts.get(str(i), 0.0) for i in range(processes)]


@pytest.mark.integration
def test_two_processes_share_the_port_and_answer_for_each_other(grouped):
    pids = _frontend_processes(grouped)
    assert len(pids) == 2, pids
    n = 24
    _completions_on_fresh_connections(grouped.url, grouped.model, n)
    for _ in range(3):  # whichever process answers /metrics and /health, they speak for both
        text = get_text(grouped.url + "/metrics")
        assert metric_values(text, "hpc_frontend_processes") == 2
        assert metric_values(text, "hpc_frontend_requests_total") == n
        per_process = _per_process(text, "hpc_frontend_process_requests_total", 2)
        assert sum(per_process) == n and min(per_process) > 0, per_process  # process 0 deals to both
        assert metric_values(text, "hpc_frontend_agg_instances") == 1
        status, health = get_json(grouped.url + "/health")
        assert status == 200 and health["processes"] == 2 and health["live"] == {"agg": 1}
        assert sum(i["routed"] for i in health["instances"]["agg"]) == n


@pytest.mark.integration
def test_held_connections_are_dealt_evenly_and_their_closing_is_counted(grouped):
    # The kernel's SO_REUSEPORT hash put 8 keep-alive connections 4 / 4 on two processes only 27 % of the time
    u = urlsplit(grouped.url)
    before = _per_process(get_text(grouped.url + "/metrics"), "hpc_frontend_process_requests_total", 2)
    held = []
    for _ in range(8):  # each is served (so dealt) before the next opens
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"model": grouped.model, "prompt": "hi", "max_tokens": 2}),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        response.read()
        held.append(conn)
    text = get_text(grouped.url + "/metrics")
    after = _per_process(text, "hpc_frontend_process_requests_total", 2)
    assert [a - b for a, b in zip(after, before)] == [4, 4], (before, after)
    # the 8 held, and the scrape's own connection
    assert sum(_per_process(text, "hpc_frontend_process_connections", 2)) == 9
    for conn in held:
        conn.close()

    def only_the_scrape_open():
        open_now = _per_process(get_text(grouped.url + "/metrics"), "hpc_frontend_process_connections", 2)
        return open_now if sum(open_now) == 1 else None
    wait_until(only_the_scrape_open, 10, "process 0 to count the closed connections")


@pytest.mark.integration
def test_the_other_processes_are_forked_before_the_etcd_client_starts_grpc(grouped):
    # A fork beside gRPC's threads can crash the child before it runs any code of its own (SIGSEGV/SIGABRT in
    # gRPC's fork handlers: 4 of 40 starts of a 4-process frontend); gRPC logs each such fork.
    log = (grouped.run.logs / "frontend.log").read_text()
    assert "instance up" in log  # discovery (the etcd client, gRPC) did start, after the fork
    assert "skipping fork() handlers" not in log


@pytest.mark.integration
def test_the_other_processes_leave_with_the_first_even_when_it_is_killed(grouped):
    first, other = _frontend_processes(grouped)
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: not alive(other), 15, "the second frontend process to leave")


# without restarts: what the group does when a process dies (under the supervisor the frontend then starts again)
failing = stack_fixture("mock-agg", "--set", "frontend.processes=3", "--set", "frontend.max_restarts=0")


@pytest.mark.integration
def test_a_process_that_dies_takes_the_frontend_down_visibly(failing):
    pids = _frontend_processes(failing)
    assert len(pids) == 3
    os.kill(pids[-1], signal.SIGKILL)
    state_file = failing.run.state / "frontend.json"

    def failed():
        state = json.loads(state_file.read_text())
        return state if state.get("phase") == "failed" else None
    state = wait_until(failed, 15, "the frontend to report failed")
    assert "frontend process" in state["error"] and "exited with code -9" in state["error"]
    wait_until(lambda: not any(alive(p) for p in pids), 15, "every frontend process to stop")


stopping = stack_fixture("mock-agg", "--set", "frontend.processes=2")


@pytest.mark.integration
def test_a_stop_signal_to_every_process_is_a_clean_stop_not_a_failure(stopping):
    pids = _frontend_processes(stopping)
    assert len(pids) == 2
    (leader,) = local_pids(stopping.run)["frontend"]
    os.killpg(leader, signal.SIGTERM)  # what hpc cancel and a Slurm step's end send: every process at once
    state_file = stopping.run.state / "frontend.json"

    def ended():
        state = json.loads(state_file.read_text())
        return state if state.get("phase") in ("stopped", "failed") else None
    state = wait_until(ended, 15, "the frontend to stop")
    assert state["phase"] == "stopped", state
    wait_until(lambda: not any(alive(p) for p in pids), 15, "every frontend process to stop")
