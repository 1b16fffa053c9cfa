"""The frontend's latency histograms: Prometheus' text format as prometheus-client wrote it (cumulative buckets,
`le` inclusive, labels sorted and escaped), and a request's clock observing TTFT, each token's gap and the
duration once."""

from __future__ import annotations

import pytest

from hpc.checks.probe import metric_values
from hpc.runtime.serve import metrics
from hpc.runtime.serve.metrics import LATENCY_BUCKETS, Histogram, LatencyHistograms

pytestmark = pytest.mark.unit


def test_buckets_are_cumulative_inclusive_and_labels_sorted_and_escaped():
    h = Histogram("x_seconds", "what it times")
    for seconds in (0.001, 0.0011, 0.0011, 200.0):  # on a bound: its own bucket; past the last bound: +Inf only
        h.observe(seconds)
    lines = h.exposition({"model": 'a "b"\\c\nd', "app": "z"})
    assert lines[:2] == ["# HELP x_seconds what it times", "# TYPE x_seconds histogram"]
    labels = '{app="z",le="0.001",model="a \\"b\\"\\\\c\\nd"}'
    assert lines[2] == f"x_seconds_bucket{labels} 1.0"
    assert lines[3] == f"x_seconds_bucket{labels.replace('0.001', '0.0025')} 3.0"
    assert lines[2 + len(LATENCY_BUCKETS) - 2].endswith(" 3.0")  # 120 s still holds only the first three
    assert lines[2 + len(LATENCY_BUCKETS) - 1] == f"x_seconds_bucket{labels.replace('0.001', '+Inf')} 4.0"
    assert lines[-2] == 'x_seconds_count{app="z",model="a \\"b\\"\\\\c\\nd"} 4.0'
    assert lines[-1].startswith("x_seconds_sum{") and float(lines[-1].rsplit(" ", 1)[1]) == pytest.approx(200.0032)


def test_a_requests_clock_observes_its_first_token_each_gap_per_token_and_its_duration(monkeypatch):
    now = iter([10.0, 10.2, 10.47, 11.1, 11.2, 12.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(now))
    latency = LatencyHistograms("hpc_frontend", {"model": "m"})
    clock = latency.start()  # 10.0
    clock.tokens(1)  # 10.2: TTFT 0.2
    clock.tokens(3)  # 10.47: 0.27 s for 3 tokens, 0.09 s each, observed once for the output
    clock.tokens(1)  # 11.1: 0.63
    clock.end()  # 11.2: the request's 1.2 s
    latency.start().end()  # 12.0: no token, so no duration either
    text = latency.exposition().decode()
    assert metric_values(text, "hpc_frontend_time_to_first_token_seconds_count") == 1
    assert metric_values(text, "hpc_frontend_time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert metric_values(text, "hpc_frontend_inter_token_latency_seconds_count") == 2
    assert metric_values(text, "hpc_frontend_inter_token_latency_seconds_sum") == pytest.approx(0.72)
    assert metric_values(text, "hpc_frontend_request_duration_seconds_count") == 1
    assert metric_values(text, "hpc_frontend_request_duration_seconds_sum") == pytest.approx(1.2)
    assert 'hpc_frontend_inter_token_latency_seconds_bucket{le="0.1",model="m"} 1.0' in text.splitlines()
