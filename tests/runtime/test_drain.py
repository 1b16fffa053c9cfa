"""Draining (hpc cancel's first tier, and Slurm's signal before a job's time limit) through a live frontend: the
worker takes no new requests, and what it serves finishes on the frontend's connection to it."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import pytest

from hpc.checks.probe import get_json, get_text, metric_values, post_json, post_sse
from hpc.cli.main import main
from tests.runtime.conftest import stack_fixture, until

pytestmark = pytest.mark.integration

TOKENS = 150  # at 20 ms a token: 3 s of stream, most of it after the drain signal
pair = stack_fixture("mock-agg", "--set", "roles.agg.count=2", "--set", "mock.per_token_delay_ms=20",
                     "--set", "frontend.router=round_robin")


def _state(stack, name: str) -> dict:
    return json.loads((stack.run.state / f"{name}.json").read_text())


def _busy(stack) -> str:
    for name in ("agg-0", "agg-1"):
        if metric_values(get_text(_state(stack, name)["http"] + "/metrics"), "hpc_worker_inflight") > 0:
            return name
    raise AssertionError("no worker has the request in flight")


def test_a_draining_worker_finishes_its_stream_and_takes_no_new_requests(pair, capsys):
    body = {"model": pair.model, "prompt": "hello", "temperature": 0, "max_tokens": TOKENS, "ignore_eos": True,
            "stream": True}
    stream = post_sse(pair.url + "/v1/completions", body, timeout=30)
    events = [next(stream)]
    busy = _busy(pair)
    other = {"agg-0": "agg-1", "agg-1": "agg-0"}[busy]
    os.kill(_state(pair, busy)["pid"], signal.SIGUSR1)
    until(lambda: _state(pair, busy)["phase"] == "draining" or _state(pair, busy)["phase"] == "drained", 5,
           f"{busy} draining")
    # new requests meanwhile all go to the other worker, and the frontend lists the draining one as such
    health = until(lambda: (lambda h: h if h["live"] == {"agg": 1} else None)(get_json(pair.url + "/health")[1]),
                    5, "the frontend sees the drain")
    assert health["status"] == "degraded"
    frontend_metrics = get_text(pair.url + "/metrics")
    assert metric_values(frontend_metrics, "hpc_frontend_agg_instances") == 1
    assert metric_values(frontend_metrics, "hpc_frontend_agg_draining_instances") == 1
    assert {i["index"]: i["draining"] for i in health["instances"]["agg"]} == {int(busy[-1]): True,
                                                                             int(other[-1]): False}
    before = metric_values(get_text(_state(pair, other)["http"] + "/metrics"), "hpc_worker_requests_total")
    for _ in range(4):
        code, answer = post_json(pair.url + "/v1/completions", {"model": pair.model, "prompt": "x", "max_tokens": 2})
        assert code == 200, answer
    assert metric_values(get_text(_state(pair, other)["http"] + "/metrics"), "hpc_worker_requests_total") == \
        before + 4
    events += list(stream)  # well past the frontend's settle window: the connection was kept
    assert "error" not in events[-1], events[-1]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len([e for e in events if e["choices"][0]["text"]]) == TOKENS
    until(lambda: _state(pair, busy)["phase"] == "drained", 5, f"{busy} drained once its stream ended")

    assert main(["status", str(pair.run.path)]) == 0
    status = capsys.readouterr().out
    assert "draining, was routed (1 requests)" in status, status
    assert "roles: agg 1/2 degraded" in status, status

    # the last one drains too: a new request is refused with the reason, not only "no live worker"
    os.kill(_state(pair, other)["pid"], signal.SIGUSR1)
    until(lambda: get_json(pair.url + "/health")[1]["live"] == {"agg": 0}, 5, "both draining")
    assert main(["status", str(pair.run.path)]) == 0
    assert "roles: agg 0/2 draining" in capsys.readouterr().out
    refused = urllib.request.Request(pair.url + "/v1/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": pair.model, "prompt": "x", "max_tokens": 2}).encode())
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(refused, timeout=10)
    assert answer.value.code == 503
    assert json.loads(answer.value.read())["error"]["message"] == (
        "no live agg worker (2 draining: the job is being cancelled or is near its time limit)")
    # the id the client got is the one the frontend's log names
    assert answer.value.headers["retry-after"] is None  # the job is ending: trying again soon would not help
    rid = answer.value.headers["x-request-id"]
    assert rid.startswith("cmpl-")
    assert f"{rid} failed: 503 no live agg worker (2 draining" in (pair.run.logs / "frontend.log").read_text()
    # streamed, the same refusal is the same status: the headers wait for the first event, which never came
    refused.data = json.dumps({"model": pair.model, "prompt": "x", "max_tokens": 2, "stream": True}).encode()
    with pytest.raises(urllib.error.HTTPError) as streamed:
        urllib.request.urlopen(refused, timeout=10)
    assert streamed.value.code == 503 and streamed.value.headers["x-request-id"].startswith("cmpl-")
    assert "2 draining" in json.loads(streamed.value.read())["error"]["message"]


single = stack_fixture("mock-agg", "--set", "mock.per_token_delay_ms=20")


def test_hpc_cancel_lets_the_stream_in_flight_finish_before_it_stops_the_run(single, capsys):
    import threading

    body = {"model": single.model, "prompt": "hello", "temperature": 0, "max_tokens": TOKENS, "ignore_eos": True,
            "stream": True}
    stream = post_sse(single.url + "/v1/completions", body, timeout=30)
    events = [next(stream)]
    cancelled: dict = {}
    cancel = threading.Thread(target=lambda: cancelled.update(code=main(["cancel", str(single.run.path),
                                                                         "--grace", "20"])))
    started = time.monotonic()
    cancel.start()
    events += list(stream)
    streamed = time.monotonic() - started
    cancel.join(30)
    assert cancelled == {"code": 0}
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    assert len([e for e in events if e["choices"][0]["text"]]) == TOKENS
    assert streamed > 1.0, "the stream ran on after the cancel began"
    assert _state(single, "agg-0")["phases"]["drained"] >= _state(single, "agg-0")["phases"]["draining"]
    said = capsys.readouterr().out
    took = float(re.search(r"stopped \S+ \(workers drained in ([0-9.]+) s\)", said).group(1))
    assert took >= streamed - 0.5, (took, streamed)  # the stream's rest was what it waited for


short = stack_fixture("mock-agg", "--set", "mock.per_token_delay_ms=20")


def test_a_grace_period_too_short_for_the_stream_says_what_was_cut(short, capsys):
    body = {"model": short.model, "prompt": "hello", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    stream = post_sse(short.url + "/v1/completions", body, timeout=30)
    next(stream)
    assert main(["cancel", str(short.run.path), "--grace", "0.5"]) == 0
    assert "error" in list(stream)[-1]  # cut, as the cancel says
    assert capsys.readouterr().out.splitlines()[-1] == ("the grace period (0.5 s) ended with agg-0 still serving: "
                                                        "what it held was cut (a longer --grace lets it finish)")


restartable = stack_fixture("mock-agg")


def test_a_frontend_that_dies_is_started_again_and_serves(restartable, capsys):
    """It holds no state: its supervisor starts it again on the same port, and the job goes on."""
    ask = {"model": restartable.model, "prompt": "x", "max_tokens": 2}
    assert post_json(restartable.url + "/v1/completions", ask)[0] == 200
    first = _state(restartable, "frontend")
    assert first["phase"] == "ready" and first["restarts"] == 0
    os.kill(first["pid"], signal.SIGKILL)  # the serving process, not its supervisor

    def serving_again():
        state = _state(restartable, "frontend")
        if state["phase"] != "ready" or state["pid"] == first["pid"]:
            return None
        try:
            return state if post_json(restartable.url + "/v1/completions", ask, timeout=5)[0] == 200 else None
        except OSError:
            return None
    again = until(serving_again, 60, "the frontend serving again")
    assert again["restarts"] == 1
    assert "the frontend exited with status -9; restart 1 of 3" in (restartable.run.logs / "frontend.log").read_text()
    assert main(["status", str(restartable.run.path)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("frontend "))
    assert row.split()[-1] == "1" and "ready" in row and "healthy" in row, row


lengthy = stack_fixture("mock-agg", "--set", "mock.per_token_delay_ms=40")


def test_a_long_grace_period_lets_a_stream_longer_than_half_a_minute_finish(lengthy, capsys):
    """The worker says "drained" only once nothing is in flight (it used to after 30 s whatever it still served,
    and the cancel then cut the stream however long its grace period)."""
    import threading

    body = {"model": lengthy.model, "prompt": "hello", "max_tokens": 800, "ignore_eos": True, "stream": True}
    stream = post_sse(lengthy.url + "/v1/completions", body, timeout=90)  # 800 x 40 ms: 32 s
    events = [next(stream)]
    cancel = threading.Thread(target=main, args=(["cancel", str(lengthy.run.path), "--grace", "60"],))
    cancel.start()
    events += list(stream)
    cancel.join(90)
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    took = float(re.search(r"workers drained in ([0-9.]+) s", capsys.readouterr().out).group(1))
    assert took > 30, took
