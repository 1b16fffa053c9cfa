"""Worker churn under load, on this machine: a decode worker (and, apart, a prefill worker) killed with SIGKILL
while 16 clients send
non-streamed requests, five times, with two CPU hogs beside it (the 404s came on a busy machine). The client has seen nothing of such an answer, so nothing they see may fail: a request
whose decode died mid-way runs again, and one whose KV that decode had taken is prefilled again (it was a 404,
"no KV cache waiting under handle", before), as is one whose prefill worker died holding its KV. The killed worker is restarted (policy restart) and routed again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from hpc.checks.probe import get_json, metric_values, get_text, post_json
from tests.runtime.conftest import stack_fixture

pytestmark = pytest.mark.integration

churn = stack_fixture("tiny-disagg", "--set", "roles.decode.count=2", "--set", "roles.prefill.count=2",
                      *[flag for role in ("prefill", "decode") for flag in (
                          "--set", f"roles.{role}.failure.on_failure=restart",
                          "--set", f"roles.{role}.failure.max_restarts=10")])
KILLS = 5


def _state(stack, name: str) -> dict:
    return json.loads((stack.run.state / f"{name}.json").read_text())


def _pid(stack, name: str) -> int:
    return _state(stack, name)["pid"]


def _back(stack, name: str, role: str, restarts: int, since: float) -> bool:
    """Restarted (its restart count past `restarts`), registered after `since`, and routed: a new pid alone
    is not enough, the frontend may not have seen the old one go yet."""
    state = _state(stack, name)
    if state.get("restarts", 0) <= restarts or state.get("phases", {}).get("registered", 0) <= since:
        return False
    return get_json(stack.url + "/health")[1]["live"].get(role) == 2


def _kill(stack, name: str) -> int:
    """SIGKILL the worker's serving process, as its state names it (a restart rewrites it: read again if gone)."""
    deadline = time.monotonic() + 20
    while True:
        pid = _pid(stack, name)
        try:
            os.kill(pid, signal.SIGKILL)
            return pid
        except ProcessLookupError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_worker_killed_under_load_fails_no_request_and_is_routed_again(churn, role):
    body = {"model": churn.model, "prompt": "the sea at night", "max_tokens": 24, "ignore_eos": True}
    results: list[int] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            code, answer = post_json(churn.url + "/v1/completions", body, timeout=60)
            results.append(code if code != 200 or answer["usage"]["completion_tokens"] == 24 else -1)

    threads = [threading.Thread(target=client) for _ in range(16)]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    for t in threads:
        t.start()
    back: list[float | None] = []
    try:
        time.sleep(2)
        for _ in range(KILLS if role == "decode" else 3):
            restarts = _state(churn, f"{role}-1").get("restarts", 0)
            since = time.time()
            _kill(churn, f"{role}-1")
            killed, took = time.monotonic(), None
            while time.monotonic() - killed < 90:
                if _back(churn, f"{role}-1", role, restarts, since):
                    took = time.monotonic() - killed
                    break
                time.sleep(0.2)
            back.append(took)
            time.sleep(1)  # requests go to it again
    finally:
        stop.set()
        for hog in hogs:
            hog.kill()
        for t in threads:
            t.join(60)
    failed = [code for code in results if code != 200]
    assert failed == [], (len(results), failed[:10])
    assert None not in back, f"{role}-1 was not restarted and routed again: {back}"
    print(f"{len(results)} requests, 0 failed; {role}-1 routed again after each kill in",
          ", ".join(f"{t:.1f}" for t in back), "s")
    text = get_text(churn.url + "/metrics")
    again = {name: metric_values(text, f"hpc_frontend_{name}") for name in ("retried_total", "kv_gone_retries_total")}
    print("run again whole:", again["retried_total"], "prefilled again, the KV gone:", again["kv_gone_retries_total"])
    assert sum(again.values()) >= 1  # the kill did land on requests in flight
