"""hpc.bench.engines: the engines' share of a request's time at the client, from each worker's counters."""

from __future__ import annotations

import json

import pytest

from hpc.bench.engines import EngineCounters, metrics_urls, share_in_engines, worker_states
from hpc.bench.report import table

pytestmark = pytest.mark.unit


def counts(requests: float, seconds: float) -> dict[str, float]:
    return {"finished_requests_total": requests, "finished_request_seconds_total": seconds}


def test_a_disaggregated_requests_time_is_its_prefill_and_its_decode_and_a_roles_workers_share_a_mean():
    before = {"prefill-0": counts(10, 1.0), "prefill-1": counts(0, 0.0), "decode-0": counts(10, 5.0)}
    # the level: 100 prefills of 1 ms over two workers (40 and 60), 100 decodes of 5 ms; 8 ms at the client
    after = {"prefill-0": counts(50, 1.04), "prefill-1": counts(60, 0.06), "decode-0": counts(110, 5.5)}
    assert share_in_engines(before, after, 0.008) == pytest.approx((0.001 + 0.005) / 0.008)


@pytest.mark.parametrize("before, after, e2e", [
    ({"agg-0": counts(0, 0)}, {"agg-0": counts(0, 0)}, 0.007),  # no request finished: an engine that does not count
    ({"agg-0": counts(0, 0)}, {"agg-0": counts(5, 0.02), "agg-1": counts(5, 0.02)}, 0.007),  # agg-1 read once
    ({"agg-0": counts(0, 0)}, {"agg-0": counts(5, 0.02)}, None),  # the client has no e2e (every request failed)
    ({}, {}, 0.007),  # no worker answered
])
def test_the_share_is_not_known_without_both_reads_requests_or_the_clients_e2e(before, after, e2e):
    assert share_in_engines(before, after, e2e) is None


def test_each_workers_metrics_url_comes_from_its_state_file(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "decode-0.json").write_text(json.dumps({"component": "decode-0", "device": "cuda:1",
                                                               "http": "http://10.0.0.2:8001"}))
    (state / "decode-0-r1.json").write_text(json.dumps({"component": "decode-0", "device": "cuda:2",
                                                                  "rank": 1}))  # no endpoint
    (state / "frontend.json").write_text(json.dumps({"component": "frontend", "http": "http://10.0.0.1:8000"}))
    (state / "etcd.json").write_text("{not json")
    assert metrics_urls(tmp_path) == {"decode-0": "http://10.0.0.2:8001"}  # not the frontend: no device
    # the benchmarks' view: every worker rank's whole state, by file
    assert {name: state["device"] for name, state in worker_states(tmp_path).items()} == \
        {"decode-0": "cuda:1", "decode-0-r1": "cuda:2"}


def test_the_table_has_the_engines_column_only_when_a_level_has_the_share():
    level = {"concurrency": 8, "input_tokens": 64, "output_tokens": 64, "output_tokens_per_request": 64.0,
             "completed": 32, "failure_rate": 0.0, "output_tokens_per_s": 1000.0, "requests_per_s": 15.6,
             "valid": True, "invalid_reasons": [], "duration_s": 2.0}
    shown = table({"levels": [{**level, "in_engines": 0.79}, {**level, "concurrency": 1, "in_engines": None}]})
    head, units, first, second, legend = shown.splitlines()
    assert head.endswith("in eng  valid") and first.endswith("   79%  yes") and second.endswith("     -  yes")
    assert units.split()[-5:] == ["ms"] * 5 and "out tok/s" in units  # every figure's unit
    over = table({"levels": [{**level, "in_engines": 1.05}]}).splitlines()[2]
    assert over.endswith(" 100%*  yes")  # past 100 % only by the clocks' disagreement
    assert legend.startswith("in eng: of a request's mean time at the client, the share inside the engines")
    assert "in eng" not in table({"levels": [level]})


def test_counters_stop_being_read_once_a_worker_does_not_answer():
    from tests.runtime.conftest import free_port

    read = EngineCounters({"agg-0": f"http://127.0.0.1:{free_port()}"}, timeout=0.5)  # nothing listens there
    assert read() == {} and read.urls == {} and read() == {}
