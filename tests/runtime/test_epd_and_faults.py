"""Encode -> prefill -> decode with images, media safety, and worker faults under a live frontend."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import time

import pytest

from hpc.checks.probe import get_json, get_text, metric_values, post_json, post_sse
from tests.runtime.conftest import stack_fixture

pytestmark = pytest.mark.integration

MEDIA = "/tmp/hpc-test-media"
epd = stack_fixture("tiny-epd", "--set", f"runtime.allowed_local_media_path={MEDIA}",
                    "--set", "runtime.max_file_size_mb=0.01")
mock = stack_fixture("mock-agg", "--set", "roles.agg.count=2", "--set", "mock.per_token_delay_ms=20",
                     "--set", "frontend.router=round_robin")


def _png(color=(10, 200, 30), size=32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def _chat(stack, image: str, stream=False):
    body = {"model": stack.model, "temperature": 0, "max_tokens": 6, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": image}}]}]}
    if stream:
        return list(post_sse(stack.url + "/v1/chat/completions", body))
    return post_json(stack.url + "/v1/chat/completions", body)


def _requests(stack, name):
    state = json.loads((stack.run.state / f"{name}.json").read_text())
    return metric_values(get_text(state["http"] + "/metrics"), "hpc_worker_requests_total")


def test_epd_chat_with_image_uses_all_three_roles(epd):
    before = {r: _requests(epd, f"{r}-0") for r in ("encode", "prefill", "decode")}
    data_url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    status, body = _chat(epd, data_url)
    assert status == 200 and body["choices"][0]["message"]["content"]
    events = _chat(epd, data_url, stream=True)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == \
        body["choices"][0]["message"]["content"]
    after = {r: _requests(epd, f"{r}-0") for r in before}
    assert all(after[r] >= before[r] + 2 for r in before), (before, after)


def test_epd_different_images_give_different_answers(epd):
    a = _chat(epd, "data:image/png;base64," + base64.b64encode(_png((255, 0, 0))).decode())[1]
    b = _chat(epd, "data:image/png;base64," + base64.b64encode(_png((0, 0, 255))).decode())[1]
    assert a["choices"][0]["message"]["content"] != b["choices"][0]["message"]["content"]


def test_local_media_inside_allowed_path_works_and_escapes_are_rejected(epd, tmp_path):
    os.makedirs(MEDIA, exist_ok=True)
    with open(f"{MEDIA}/ok.png", "wb") as f:
        f.write(_png(size=8))
    assert _chat(epd, f"{MEDIA}/ok.png")[0] == 200
    secret = tmp_path / "secret.png"
    secret.write_bytes(_png(size=8))
    link = f"{MEDIA}/link.png"
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(secret, link)
    for ref, needle in ((f"{MEDIA}/../etc/passwd", ".."), (str(secret), "outside"), (link, "outside"),
                        (f"file://{secret}", "outside")):
        code, body = _chat(epd, ref)
        assert code == 400 and needle in body["error"]["message"], (ref, body)


def test_oversize_image_rejected(epd):
    big = "data:image/png;base64," + base64.b64encode(_png(size=512) + os.urandom(20000)).decode()
    code, body = _chat(epd, big)
    assert code == 400 and "max_file_size_mb" in body["error"]["message"]


def test_one_request_traced_through_every_log_by_its_id(epd, capsys):
    """The encode worker dies for good: an image request fails on the prefill worker, and
    `hpc logs RUN --request ID` (the x-request-id the client got) shows the frontend's and that worker's lines.
    Last of the epd tests: the stack has no encode worker after it."""
    import urllib.error
    import urllib.request

    from hpc.cli.main import main

    os.killpg(_worker_pid(epd, "encode-0"), signal.SIGKILL)
    body = {"model": epd.model, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png()).decode()}}]}]}
    ask = urllib.request.Request(epd.url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(ask, timeout=30)
    rid = failed.value.headers["x-request-id"]
    assert failed.value.code >= 500 and rid.startswith("chatcmpl-")
    capsys.readouterr()
    assert main(["logs", str(epd.run.path), "--request", rid]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in lines} == {"frontend", "prefill-0"}, lines
    assert all(rid in line for line in lines)
    assert any(f"{rid} (GenerateRequest) failed: 502 encode worker at " in line for line in lines), lines
    assert main(["logs", str(epd.run.path), "--request", "chatcmpl-none"]) == 1
    assert "no log line of" in capsys.readouterr().out


def test_text_only_model_rejects_images(mock):
    code, body = _chat(mock, "data:image/png;base64,AAAA")
    assert code == 400


def _worker_pid(stack, name) -> int:
    pids = json.loads((stack.run.path / "local.json").read_text())["pids"]
    return pids[name][0]


def test_killed_worker_mid_stream_ends_stream_with_error_and_others_keep_serving(mock):
    body = {"model": mock.model, "prompt": "hello", "temperature": 0, "max_tokens": 300, "stream": True}
    stream = post_sse(mock.url + "/v1/completions", body, timeout=30)
    first = next(stream)
    assert first["choices"][0]["text"]
    # find the worker serving it: the one with a request in flight
    busy = None
    for name in ("agg-0", "agg-1"):
        state = json.loads((mock.run.state / f"{name}.json").read_text())
        if metric_values(get_text(state["http"] + "/metrics"), "hpc_worker_inflight") > 0:
            busy = name
    assert busy is not None
    os.killpg(_worker_pid(mock, busy), signal.SIGKILL)
    t0 = time.monotonic()
    rest = list(stream)  # must end, not hang
    assert time.monotonic() - t0 < 5
    assert "error" in rest[-1]
    # the frontend's log names the failed request by the id its client saw
    logged = (mock.run.logs / "frontend.log").read_text()
    assert f"{first['id']} failed: 502 agg worker agg/" in logged, logged[-2000:]
    # requests right after the kill are routed to the survivor (or retried there): none fails
    for _ in range(10):
        code, resp = post_json(mock.url + "/v1/completions", {"model": mock.model, "prompt": "x", "temperature": 0, "max_tokens": 3})
        assert code == 200, resp
    code, health = get_json(mock.url + "/health")
    assert health["live"] == {"agg": 1} and health["status"] == "degraded"


def test_hung_worker_leaves_routing_within_two_seconds(mock):
    """SIGSTOP keeps the TCP connection open, so only the lease expiry can remove it."""
    code, health = get_json(mock.url + "/health")
    (survivor,) = health["instances"]["agg"]
    name = f"agg-{survivor['index']}"
    state = json.loads((mock.run.state / f"{name}.json").read_text())
    pid = state["pid"]  # the engine process itself (the supervisor is its parent)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            if get_json(mock.url + "/health")[1]["live"].get("agg", 0) == 0:
                break
            time.sleep(0.05)
        gone_after = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert gone_after <= 2.0, f"hung worker still routed after {gone_after:.2f} s"
    deadline = time.monotonic() + 5  # resumed, it takes a new lease and is routed again
    while time.monotonic() < deadline and get_json(mock.url + "/health")[1]["live"].get("agg", 0) == 0:
        time.sleep(0.05)
    assert get_json(mock.url + "/health")[1]["live"].get("agg", 0) == 1


def test_a_component_that_dies_at_start_fails_the_launch_at_once(tmp_path, monkeypatch, model_cache, capsys):
    """Not a readiness timeout later: the launch notices the exited process and says which one."""
    import time

    from hpc.cli.main import main
    from hpc.launch.local import alive, local_pids
    from hpc.rundir import list_runs

    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    started = time.monotonic()
    code = main(["launch", "-r", "tiny-agg", "--no-smoke", "--set", "roles.agg.env.PYTHONHOME=/nonexistent",
                 "--set", f"model.path={model_cache / 'tiny'}", "--set", "runtime.readiness_timeout_s=600"])
    elapsed = time.monotonic() - started
    (run,) = list_runs()
    main(["cancel", str(run.path), "--grace", "2"])
    assert code == 1
    assert "agg-0 exited" in capsys.readouterr().err
    assert elapsed < 60, f"took {elapsed:.0f} s: the launch waited instead of noticing the exit"
    assert not [p for pids in local_pids(run).values() for p in pids if alive(p)]


retry = stack_fixture("mock-agg", "--set", "roles.agg.count=2", "--set", "mock.per_token_delay_ms=20")


def test_a_non_streamed_request_survives_its_worker_being_killed(retry):
    """The client has seen nothing of a non-streamed answer: the frontend runs it again on a survivor."""
    import threading

    result: dict = {}

    def call() -> None:
        result["answer"] = post_json(retry.url + "/v1/completions",
                                     {"model": retry.model, "prompt": "hello", "temperature": 0, "max_tokens": 100,
                                      "ignore_eos": True}, timeout=30)

    thread = threading.Thread(target=call)
    thread.start()
    busy, deadline = None, time.monotonic() + 10
    while busy is None and time.monotonic() < deadline:
        for name in ("agg-0", "agg-1"):
            state = json.loads((retry.run.state / f"{name}.json").read_text())
            if metric_values(get_text(state["http"] + "/metrics"), "hpc_worker_inflight") > 0:
                busy = name
        time.sleep(0.05)
    assert busy is not None
    os.killpg(_worker_pid(retry, busy), signal.SIGKILL)
    thread.join(30)
    code, body = result["answer"]
    assert code == 200 and body["usage"]["completion_tokens"] == 100, body
    assert metric_values(get_text(retry.url + "/metrics"), "hpc_frontend_retried_total") == 1
