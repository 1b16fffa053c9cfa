"""Hostile requests, one table: each is refused with its status and the field it names, the message one bounded
line, and after every one the service still answers (its liveness and a small completion).

Each row is (route, body, status, param): `param` is what the error's `param` must name (None: the route or the
body as a whole). A body given as bytes is sent as it is.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.runtime.conftest import stack_fixture

pytestmark = pytest.mark.integration

agg = stack_fixture("tiny-agg", "--set", "model.tool_call_parser=hermes")
C, CH = "/v1/completions", "/v1/chat/completions"
M = {"model": "hpc/tiny"}
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def c(**fields) -> dict:
    return {**M, "prompt": "hi", "max_tokens": 2, **fields}


def ch(**fields) -> dict:
    return {**M, "messages": MSG, "max_tokens": 2, **fields}


CASES = [
    # the prompt, every way it can be wrong
    (C, {**M, "max_tokens": 2}, 400, "prompt"),
    (C, c(prompt=None), 400, "prompt"),
    (C, c(prompt=5), 400, "prompt"),
    (C, c(prompt={}), 400, "prompt"),
    (C, c(prompt=""), 400, "prompt"),
    (C, c(prompt=[]), 400, "prompt"),
    (C, c(prompt=[[]]), 400, "prompt"),
    (C, c(prompt=[1, "a"]), 400, "prompt"),
    (C, c(prompt=[-1]), 400, "prompt"),
    (C, c(prompt=[2**31]), 400, "prompt"),
    (C, c(prompt=[2**64 + 1]), 400, "prompt"),
    (C, c(prompt=[1.5]), 400, "prompt"),
    (C, c(prompt=[True, False]), 400, "prompt"),
    (C, c(prompt=[[1, 2], "text"]), 400, "prompt"),
    (C, c(prompt=["a", None]), 400, "prompt"),
    (C, c(prompt="x " * 5000), 400, "prompt"),
    (C, c(prompt=[[1, 2], [3, -4]]), 400, "prompt"),
    (C, c(prompt=["ok", 5]), 400, "prompt"),
    (C, c(prompt=["a", "b"], stream=True), 400, "stream"),
    # the model
    (C, {"prompt": "hi"}, 400, "model"),
    (C, c(model=5), 400, "model"),
    (C, c(model=None), 400, "model"),
    (C, c(model="nope"), 404, "model"),
    (C, c(model="m" * 1_000_000), 404, "model"),
    (C, c(model=["hpc/tiny"]), 400, "model"),
    # lengths
    (C, c(max_tokens=-1), 400, "max_tokens"),
    (C, c(max_tokens="16"), 400, "max_tokens"),
    (C, c(max_tokens=1.5), 400, "max_tokens"),
    (C, c(max_tokens=True), 400, "max_tokens"),
    (C, c(max_tokens=10**12), 400, "max_tokens"),
    (C, c(max_tokens=100_000), 400, "max_tokens"),
    (C, c(max_tokens=0), 400, "max_tokens"),
    (C, c(max_tokens=0, echo=True, stream=True), 400, "stream"),
    (C, c(min_tokens=-1), 400, "min_tokens"),
    (C, c(min_tokens=5), 400, "min_tokens"),
    (C, c(min_tokens="1"), 400, "min_tokens"),
    # sampling
    (C, c(temperature=-0.1), 400, "temperature"),
    (C, c(temperature=2.5), 400, "temperature"),
    (C, c(temperature="hot"), 400, "temperature"),
    (C, c(top_p=0), 400, "top_p"),
    (C, c(top_p=1.5), 400, "top_p"),
    (C, c(top_p="0.5"), 400, "top_p"),
    (C, c(top_k=-1), 400, "top_k"),
    (C, c(top_k=10**12), 400, "top_k"),
    (C, c(n=0), 400, "n"),
    (C, c(n=129), 400, "n"),
    (C, c(n="2"), 400, "n"),
    (C, c(seed=-1), 400, "seed"),
    (C, c(seed=2**64), 400, "seed"),
    (C, c(seed="7"), 400, "seed"),
    (C, c(presence_penalty=3), 400, "presence_penalty"),
    (C, c(frequency_penalty=-3), 400, "frequency_penalty"),
    (C, c(repetition_penalty=0), 400, "repetition_penalty"),
    (C, c(repetition_penalty=-1.0), 400, "repetition_penalty"),
    (C, c(repetition_penalty=11), 400, "repetition_penalty"),
    (C, c(ignore_eos="true"), 400, "ignore_eos"),
    (C, c(best_of=2), 400, "best_of"),
    (C, c(suffix="tail"), 400, "suffix"),
    (C, c(logit_bias={"5": 10}), 400, "logit_bias"),
    # stops, echo, logprobs, streams
    (C, c(stop=5), 400, "stop"),
    (C, c(stop=[5]), 400, "stop"),
    (C, c(stop=[""]), 400, "stop"),
    (C, c(stop=["a"] * 33), 400, "stop"),
    (C, c(stop=["x" * 5000]), 400, "stop"),
    (C, c(echo="yes"), 400, "echo"),
    (C, c(logprobs=-1), 400, "logprobs"),
    (C, c(logprobs=21), 400, "logprobs"),
    (C, c(logprobs="2"), 400, "logprobs"),
    (C, c(stream="yes"), 400, "stream"),
    (C, c(stream=1), 400, "stream"),
    (C, c(stream_options={"include_usage": True}), 400, "stream_options"),
    (C, c(stream=True, stream_options={"bogus": True}), 400, "stream_options.bogus"),
    (C, c(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    (C, c(stream=True, stream_options=["include_usage"]), 400, "stream_options"),
    # unknown fields and extensions' shapes
    (C, c(max_tokenz=5), 400, "max_tokenz"),
    (C, c(temprature=0.5), 400, "temprature"),
    (C, c(**{"": 1}), 400, ""),
    (C, c(nvext={"router": {"ttft_target": -5}}), 400, "nvext.router.ttft_target"),
    (C, c(nvext=5), 400, "nvext"),
    (C, c(extra_args={"ttft_target": -1}), 400, "extra_args.ttft_target"),
    (C, c(extra_args={"ttft_target": "fast"}), 400, "extra_args.ttft_target"),
    # chat: messages
    (CH, {**M, "max_tokens": 2}, 400, "messages"),
    (CH, ch(messages=[]), 400, "messages"),
    (CH, ch(messages="hi"), 400, "messages"),
    (CH, ch(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    (CH, ch(messages=[{"content": "x"}]), 400, "messages.0.role"),
    (CH, ch(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    (CH, ch(messages=[{"role": "user", "content": [{"type": "bogus"}]}]), 400, "messages.0.content.0.type"),
    (CH, ch(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages.0.content.0.text"),
    (CH, ch(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400,
     "messages.0.content.0.text"),
    (CH, ch(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None}]}]),
     400, "messages.0.content.1.text"),
    (CH, ch(messages=[5]), 400, "messages.0"),
    (CH, ch(messages=[None]), 400, "messages.0"),
    (CH, ch(messages=[{"role": "user", "content": "x", "bogus": 1}]), 400, "messages.0.bogus"),
    (CH, ch(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": None}}]}]),
     400, "messages.0.content.0"),
    (CH, ch(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "bogus": 1}]),
     400, "messages.1.bogus"),
    (CH, ch(messages=[{"role": "user", "content": "x" * 600_000}]), 400, "messages"),
    # chat: tools
    (CH, ch(tools=[{"type": "function"}]), 400, "tools.0.function"),
    (CH, ch(tools=[{"type": "retrieval"}]), 400, "tools.0.type"),
    (CH, ch(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "tools.0.function.name"),
    (CH, ch(tools=[{"type": "function", "function": {"name": "f", "parameters": "schema"}}]),
     400, "tools.0.function.parameters"),
    (CH, ch(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     400, "tools.0.function.parameters"),
    (CH, ch(tools="f"), 400, "tools"),
    (CH, ch(tools=[TOOL] * 129), 400, "tools"),
    (CH, ch(tool_choice="required"), 400, "tool_choice"),
    (CH, ch(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), 400, "tool_choice"),
    (CH, ch(tools=[TOOL], tool_choice="sometimes"), 400, "tool_choice"),
    (CH, ch(tools=[TOOL], tool_choice=5), 400, "tool_choice"),
    # chat: the rest of OpenAI's fields
    (CH, ch(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
     400, "response_format"),
    (CH, ch(response_format="json"), 400, "response_format"),
    (CH, ch(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CH, ch(top_logprobs=3), 400, "top_logprobs"),
    (CH, ch(logprobs=5), 400, "logprobs"),
    (CH, ch(max_completion_tokens=-1), 400, "max_completion_tokens"),
    (CH, ch(max_completion_tokens="3"), 400, "max_completion_tokens"),
    (CH, ch(reasoning_effort="low"), 400, "reasoning_effort"),
    (CH, ch(chat_template_kwargs="thinking"), 400, "chat_template_kwargs"),
    (CH, ch(parallel_tool_calls=False), 400, "parallel_tool_calls"),
    (CH, ch(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    (CH, ch(modalities=["text", "audio"]), 400, "modalities"),
    (CH, ch(functions=[{"name": "f"}]), 400, "functions"),
    (CH, ch(function_call={"name": "f"}), 400, "function_call"),
    (CH, ch(store=True), 400, "store"),
    (CH, ch(prediction={"type": "content", "content": "x"}), 400, "prediction"),
    (CH, ch(web_search_options={}), 400, "web_search_options"),
    (CH, ch(n=2, stream="no"), 400, "stream"),
    (CH, ch(stop=["a"] * 33), 400, "stop"),
    (CH, ch(max_tokenz=3), 400, "max_tokenz"),
    (CH, ch(messages=[{"role": "user", "content": None, "name": 5}]), 400, "messages.0.name"),
    (CH, ch(messages=[{"role": "tool", "content": "x", "tool_call_id": 7}]), 400, "messages.0.tool_call_id"),
    (CH, ch(messages=[{"role": "assistant", "tool_calls": "f"}]), 400, "messages.0.tool_calls"),
    (CH, ch(messages=[{"role": "USER", "content": "x"}]), 400, "messages.0.role"),
    (CH, ch(messages=MSG * 5000), 400, "messages"),
    (CH, ch(temperature=None), 400, "temperature"),
    (CH, ch(top_k="5"), 400, "top_k"),
    (CH, ch(seed=1.5), 400, "seed"),
    (CH, ch(n=2, seed=2**63), 400, "seed"),
    (CH, ch(stream=True, stream_options={"continuous_usage_stats": 1}), 400,
     "stream_options.continuous_usage_stats"),
    # bodies that are not a request
    (C, b"{", 400, None),
    (C, b"", 400, None),
    (C, b"[]", 400, None),
    (C, b'"text"', 400, None),
    (C, b"null", 400, None),
    (C, b"\xff\xfe{}", 400, None),
    (C, b"[" * 100_000 + b"]" * 100_000, 400, None),
    (C, b'{"model": "hpc/tiny", "prompt": "hi", "temperature": NaN}', 400, None),  # not JSON
    (C, b'{"model": "hpc/tiny", "prompt": "hi", "temperature": Infinity}', 400, None),
    (C, b'{"model": "hpc/tiny", "prompt": "hi", "max_tokens": 1e400}', 400, None),
    (C, b'{"model": "hpc/tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),
    (CH, b'{"model": "hpc/tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400, None),
]

ROUTES = [  # (method, path, status)
    ("GET", C, 405), ("PUT", CH, 405), ("DELETE", "/v1/models", 405), ("POST", "/v1/models", 405),
    ("GET", "/v1/models/nope", 404), ("GET", "/v1/models/" + "n" * 5000, 404), ("GET", "/nope", 404),
    ("GET", "/v1/../etc/passwd", 404), ("POST", "/v1/videos", 404), ("GET", "/v1/videos/nope", 404),
]


def _send(url: str, method: str, data: bytes | None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw.startswith(b"{") else {"raw": raw[:200].decode("latin-1")}


def _still_serving(url: str) -> None:
    with urllib.request.urlopen(url + "/live", timeout=5) as resp:
        assert resp.status == 200
    status, body = _send(url + C, "POST", json.dumps(c()).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


@pytest.mark.parametrize("route, body, status, param", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_a_hostile_request_is_refused_naming_its_field(agg, route, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = _send(agg.url + route, "POST", data)
    assert got == status, (got, answer)
    error = answer["error"]
    message = error["message"]
    assert "\n" not in message and len(message) <= 1200, message  # one bounded line, whatever came in
    if param is not None:
        assert error["param"] == param, error
    _still_serving(agg.url)


@pytest.mark.parametrize("method, path, status", ROUTES)
def test_a_route_that_is_not_served_says_so(agg, method, path, status):
    got, answer = _send(agg.url + path, method, b"{}" if method in ("POST", "PUT") else None)
    assert got == status and len(answer["error"]["message"]) <= 600, answer
    _still_serving(agg.url)


def test_the_suite_is_as_wide_as_the_issue_asks():
    assert len(CASES) + len(ROUTES) >= 150
