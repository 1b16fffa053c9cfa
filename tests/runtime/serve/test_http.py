"""What the HTTP server owes its clients, over raw sockets (loopback only)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from hpc.runtime.serve.http import HttpLimits, HttpServer, Request, Response, json_response

pytestmark = pytest.mark.unit


RELEASE = asyncio.Event()  # holds /hold requests in the handler (the concurrency limit's test)


async def _handler(req: Request) -> Response:
    if req.path == "/echo":
        return json_response({"method": req.method, "length": len(req.body), "body": req.body.decode()})
    if req.path == "/hold":
        await asyncio.sleep(1.0)
        return json_response({"held": True})
    if req.path == "/broken-stream":
        async def broken():
            yield b"data: {}\n\n"
            raise RuntimeError("the engine died mid-stream")
        return Response(content_type="text/event-stream", stream=broken())
    if req.path == "/metrics" and req.method == "GET":
        return Response(body=b"hpc_up 1\n", content_type="text/plain")
    if req.path == "/stream":
        async def chunks():
            yield b"data: 1\n\n"
        return Response(content_type="text/event-stream", stream=chunks())
    if req.path == "/burst":
        async def burst():  # three made in one turn of the loop (outputs that waited), then one later
            for n in (1, 2, 3):
                yield b"data: %d\n\n" % n
            await asyncio.sleep(0.05)
            yield b"data: 4\n\n"
        return Response(content_type="text/event-stream", stream=burst())
    return json_response({"error": "not found"}, 404)


def _exchange(port: int, raw: bytes, reads: int = 1) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw)
        data = b""
        sock.settimeout(0.5)
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            pass
    return data


LIMITS = HttpLimits(max_header_bytes=8192, max_body_bytes=4096, header_timeout_s=0.5, body_timeout_s=0.5,
                    keepalive_timeout_s=0.5, max_concurrent=2)


@pytest.fixture
def served():
    loop = asyncio.new_event_loop()
    srv = HttpServer(_handler, LIMITS)
    loop.run_until_complete(srv.start("127.0.0.1", 0))
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield srv
    asyncio.run_coroutine_threadsafe(srv.close(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending))
    loop.close()


@pytest.fixture
def server(served):
    return served.port


class _CountedWrites:
    """The connection's transport, each write kept (the server's sends, one by one)."""

    def __init__(self, inner, writes: list[bytes]) -> None:
        self.inner, self.writes = inner, writes

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.inner.write(data)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_streams_chunks_made_in_one_turn_of_the_loop_leave_in_one_send(server, monkeypatch):
    import hpc.runtime.serve.http as http

    writes: list[bytes] = []
    made = http._Protocol.connection_made
    monkeypatch.setattr(http._Protocol, "connection_made",
                        lambda self, transport: made(self, _CountedWrites(transport, writes)))
    reply = _exchange(server, b"GET /burst HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply.count(b"data: ") == 4 and reply.endswith(b"0\r\n\r\n"), reply
    events = [w for w in writes if b"data: " in w]
    assert [w.count(b"data: ") for w in events] == [3, 1], writes  # the burst together, the late one alone
    assert events[0] == b"".join(b"9\r\ndata: %d\n\n\r\n" % n for n in (1, 2, 3))


def test_head_answers_like_get_without_a_body_and_keeps_the_connection_usable(server):
    data = _exchange(server, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    first, rest = data.split(b"\r\n\r\n", 1)
    assert first.startswith(b"HTTP/1.1 200") and b"content-length: 9" in first.lower()
    assert rest.startswith(b"HTTP/1.1 200")  # no HEAD body in between: the next response follows directly
    assert rest.endswith(b"hpc_up 1\n")


def test_head_on_a_stream_sends_headers_only(server):
    data = _exchange(server, b"HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and body == b""


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


def _until_closed(port: int, raw: bytes, wait: float = 3.0) -> tuple[bytes, float]:
    """Send raw, then read until the server closes the connection; what came back and how long it took."""
    import time

    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        t0 = time.monotonic()
        sock.sendall(raw)
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                return data, float("inf")  # still open
            if not chunk:
                return data, time.monotonic() - t0
            data += chunk


def test_slowloris_connections_are_closed_at_the_header_timeout(served):
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", served.port), timeout=3)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never finishes the headers
        socks.append(s)
    answers = []
    for s in socks:
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        answers.append(_status(data))
        s.close()
    assert answers == [408] * 50
    assert served.connections == 0


def test_a_lying_content_length_times_out_with_408(server):
    data, took = _until_closed(server, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly-10b")
    assert _status(data) == 408 and took < 2.0


def test_idle_keepalive_connections_are_closed(server):
    data, took = _until_closed(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status(data) == 200 and 0.3 < took < 2.0


def test_a_chunked_request_body_is_one_request(server):
    raw = (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
           b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    data, _ = _until_closed(server, raw)
    assert data.count(b"HTTP/1.1 ") == 1 and _status(data) == 200
    assert b'"body":"hello world"' in data and b'"length":11' in data


def test_expect_100_continue_gets_an_interim_answer_before_the_body(server):
    with socket.create_connection(("127.0.0.1", server), timeout=3) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n"
                     b"Connection: close\r\n\r\n")
        assert sock.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"ping")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert _status(data) == 200 and b'"body":"ping"' in data


def test_expect_100_continue_with_an_oversize_body_is_refused_before_it_is_sent(server):
    data, _ = _until_closed(server, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n"
                                    b"Expect: 100-continue\r\n\r\n")
    assert _status(data) == 413 and b"100 Continue" not in data


def test_http10_gets_no_chunked_reply_and_the_connection_closes(server):
    data, took = _until_closed(server, b"GET /stream HTTP/1.0\r\n\r\n")
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in head.lower()
    assert body == b"data: 1\n\n" and took < 0.4  # closed at the end of the body, not by the idle timer


def test_http10_keep_alive_when_asked(server):
    data = _exchange(server, b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
                             b"GET /metrics HTTP/1.0\r\n\r\n")
    assert data.count(b"HTTP/1.0 200") == 2 and b"connection: keep-alive" in data.lower()


@pytest.mark.parametrize("raw", [
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    b"GARBAGE\r\n\r\n",
], ids=["duplicate-content-length", "content-length-and-chunked", "not-http"])
def test_ambiguous_or_malformed_framing_is_400_and_closed(server, raw):
    data, took = _until_closed(server, raw)
    assert _status(data) == 400 and data.count(b"HTTP/1.1 ") == 1 and took < 1.0


def test_oversize_headers_and_bodies(server):
    data, _ = _until_closed(server, b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
    assert _status(data) == 431
    data, _ = _until_closed(server, b"POST /echo HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + b"a" * 5000)
    assert _status(data) == 413
    chunked = b"".join(b"400\r\n" + b"a" * 1024 + b"\r\n" for _ in range(5))  # no length announced
    data, _ = _until_closed(server, b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
    assert _status(data) == 413


def test_an_error_mid_stream_ends_the_stream_with_an_sse_event_not_a_status_line(server):
    data, took = _until_closed(server, b"GET /broken-stream HTTP/1.1\r\nHost: x\r\n\r\n")
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"HTTP/1.1" not in body
    assert b"event: error" in body and body.endswith(b"0\r\n\r\n") and took < 1.0


def test_full_server_answers_503_with_retry_after_and_still_answers_probes(server):
    import concurrent.futures

    def post(path: str) -> bytes:
        data, _ = _until_closed(server, f"POST {path} HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                                .encode())
        return data

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(post, "/hold") for _ in range(2)]
        import time

        time.sleep(0.3)  # both held in the handler: the server is at max_concurrent=2
        refused = post("/echo")
        probe, _ = _until_closed(server, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        statuses = [_status(f.result()) for f in held]
    assert statuses == [200, 200]
    assert _status(refused) == 503 and b"retry-after: 1" in refused.lower()
    assert _status(probe) == 200


def test_pipelined_requests_are_answered_in_order(server):
    raw = b"".join(b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\n\r\n%d" % i for i in range(5))
    data = _exchange(server, raw)
    assert data.count(b"HTTP/1.1 200") == 5
    assert [data.index(b'"body":"%d"' % i) for i in range(5)] == sorted(data.index(b'"body":"%d"' % i)
                                                                         for i in range(5))
