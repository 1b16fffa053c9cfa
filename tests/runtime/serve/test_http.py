"""What the HTTP server owes its clients, over raw sockets (loopback only)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from hpc.runtime.serve.http import HttpServer, Request, Response, json_response

pytestmark = pytest.mark.unit


async def _handler(req: Request) -> Response:
    if req.path == "/metrics" and req.method == "GET":
        return Response(body=b"hpc_up 1\n", content_type="text/plain")
    if req.path == "/stream":
        async def chunks():
            yield b"data: 1\n\n"
        return Response(content_type="text/event-stream", stream=chunks())
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


@pytest.fixture
def server():
    loop = asyncio.new_event_loop()
    srv = HttpServer(_handler)
    loop.run_until_complete(srv.start("127.0.0.1", 0))
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield srv.port
    loop.call_soon_threadsafe(loop.stop)


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
