"""A KV transfer made to stall on the dev cluster (the prefill node's namespace drops what it sends to the decode
node, after the job is up): the request fails within its deadline (runtime.kv_transfer_min_s) with the decode's
error naming the prefill worker (a 502 from the frontend, as for every worker's failure), no request hangs, and
serving comes back once the route does."""

from __future__ import annotations

import subprocess
import time

import pytest

from hpc.checks.probe import post_json
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
