"""frontend.request_timeout_s is enforced end to end: 504 (or an SSE error event) and the engine work cancelled."""

from __future__ import annotations

import json
import time

import pytest

from hpc.checks.probe import get_text, metric_values, post_json, post_sse
from tests.runtime.conftest import stack_fixture

pytestmark = pytest.mark.integration

slow = stack_fixture("mock-agg", "--set", "mock.per_token_delay_ms=50", "--set", "frontend.request_timeout_s=0.5",
                     "--set", "limits.max_output_tokens=1000")


def _running(stack) -> float:
    state = json.loads((stack.run.state / "agg-0.json").read_text())
    return metric_values(get_text(state["http"] + "/metrics"), "hpc_worker_running")


def test_a_request_past_its_deadline_is_a_504_and_its_engine_work_stops(slow):
    t0 = time.monotonic()
    status, body = post_json(slow.url + "/v1/completions", {"model": slow.model, "prompt": "x", "temperature": 0, "max_tokens": 400})
    took = time.monotonic() - t0
    assert status == 504 and body["error"]["code"] == "timeout" and 0.45 < took < 2.0, (status, body, took)
    deadline = time.monotonic() + 2
    while _running(slow) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(slow) == 0  # 400 tokens x 50 ms would have run for 20 s


def test_a_stream_past_its_deadline_ends_with_an_error_event(slow):
    events = list(post_sse(slow.url + "/v1/completions", {"model": slow.model, "prompt": "x", "temperature": 0, "max_tokens": 400,
                                                          "stream": True}))
    assert events and events[-1]["error"]["code"] == "timeout"
    assert 1 <= sum(1 for e in events if "choices" in e) < 40  # tokens flowed, then the deadline cut them


def test_a_request_within_its_deadline_is_untouched(slow):
    status, body = post_json(slow.url + "/v1/completions", {"model": slow.model, "prompt": "x", "temperature": 0, "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
