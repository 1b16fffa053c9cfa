"""A KV transfer made to stall on the dev cluster (the prefill node's namespace drops what it sends to the decode
node, after the job is up). With one pair, the request fails within its deadline (runtime.kv_transfer_min_s) with
the decode's error naming the prefill worker (a 502 from the frontend, as for every worker's failure), no request
hangs, and serving comes back once the route does. With another pair, the request goes on there and succeeds; the
pair that keeps timing out leaves routing, shown in hpc status and /metrics, and comes back once it recovers."""

from __future__ import annotations

import subprocess
import time

import pytest

from hpc.checks.probe import post_json, reach_json
from hpc.cli.main import main
from tests.slurm.test_serving_on_slurm import _cancel_and_check_clean, _complete, _launch, _url

pytestmark = pytest.mark.slurm
ROUTE = ["blackhole", "10.77.0.13/32"]  # on node2 (prefill-0): what it sends to node3 (decode-0) is dropped


def test_a_stalled_kv_transfer_fails_its_request_within_its_deadline(slurm_env):
    run = _launch("-c", "dev", "-r", "tiny-disagg", "--set", "runtime.kv_transfer_min_s=3", "--no-smoke")
    url = _url(run)
    try:
        assert _complete(url, "hpc/tiny")  # the path works, and the decode's connection to the prefill is open
        subprocess.run(["ip", "-n", "hpc-node2", "route", "add", *ROUTE], check=True)
        try:
            t0 = time.monotonic()
            status, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": "stalled", "max_tokens": 8,
                                                               "ignore_eos": True}, timeout=60)
            took = time.monotonic() - t0
        finally:
            subprocess.run(["ip", "-n", "hpc-node2", "route", "del", *ROUTE], check=True)
        assert status == 502 and body["error"]["type"] == "upstream_error", (status, body)  # the decode's 504
        assert "passed its deadline" in str(body) and "runtime.kv_transfer_min_s 3" in str(body), body
        print(f"the stalled transfer's request failed in {took:.2f} s")
        assert took < 3 + 10, took  # its deadline (and the frontend's hop), not the request's 600 s
        deadline = time.monotonic() + 60
        while True:  # the route is back: serving comes back (a connection the drop broke is made again)
            status, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": "again", "max_tokens": 4},
                                     timeout=30)
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert status == 200, body
    finally:
        _cancel_and_check_clean(run)


def _pairs(url: str) -> list[dict]:
    answer = reach_json(url + "/health", 5.0)
    assert answer is not None
    return answer[1]["router"]["kv_pairs"]


def test_a_stalled_pair_is_retried_on_another_then_sits_out_until_it_recovers(slurm_env, capsys):
    # prefill-0 and decode-0 on node2, decode-1 on node3: the route drops prefill-0 -> decode-1 only
    run = _launch("-c", "dev", "-r", "tiny-disagg", "--set", "roles.decode.count=2", "--set", "placement=pack",
                  "--set", "runtime.kv_transfer_min_s=3", "--set", "runtime.kv_pair_cooldown_s=5", "--no-smoke")
    url = _url(run)
    states = run.component_states()
    assert (states["prefill-0"]["node"], states["decode-0"]["node"], states["decode-1"]["node"]) == \
        ("node2", "node2", "node3")
    body = {"model": "hpc/tiny", "prompt": "a pair", "max_tokens": 8, "ignore_eos": True}
    try:
        for _ in range(2):
            assert _complete(url, "hpc/tiny")  # both decode workers have their connection to the prefill open
        subprocess.run(["ip", "-n", "hpc-node2", "route", "add", *ROUTE], check=True)
        try:
            took = []
            for _ in range(6):
                t0 = time.monotonic()
                status, answer = post_json(url + "/v1/completions", body, timeout=60)
                took.append(time.monotonic() - t0)
                assert status == 200, answer  # retried on prefill-0 -> decode-0, not failed
                assert answer["usage"]["completion_tokens"] == 8
            (pair,) = _pairs(url)
            assert (pair["prefill"], pair["decode"], pair["timeouts"], pair["retried"]) == \
                ("prefill-0", "decode-1", 2, 2), pair
            assert pair["benched_s"] > 0  # two in a row: it sits out
            print("requests under the stalled pair took", [f"{t:.1f}" for t in took], "s")
            assert sum(t > 3 for t in took) == 2 and all(t < 3 + 8 for t in took), took  # after that, no wait
            assert main(["status", run.job_id()]) == 0
            out = capsys.readouterr().out
            assert "kv transfers prefill-0 -> decode-1: 2 timed out, 2 retried on another pair; out of routing" in out
            metrics = subprocess.run(["curl", "-s", url + "/metrics"], capture_output=True, text=True).stdout
            assert 'hpc_frontend_kv_pair_timeouts_total{' in metrics and 'decode="decode-1"' in metrics
        finally:
            subprocess.run(["ip", "-n", "hpc-node2", "route", "del", *ROUTE], check=True)
        time.sleep(6)  # past the cooldown: the next request that picks decode-1 tries the pair again
        deadline = time.monotonic() + 90  # a TCP connection the drop stalled resends on its own backoff
        while _pairs(url)[0]["in_a_row"] and time.monotonic() < deadline:
            status, answer = post_json(url + "/v1/completions", body, timeout=60)
            assert status == 200, answer  # meanwhile every request is served
        (pair,) = _pairs(url)
        assert pair["in_a_row"] == 0 and pair["benched_s"] == 0, pair  # a transfer on it landed: it is back
    finally:
        _cancel_and_check_clean(run)
