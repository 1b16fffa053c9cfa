"""hpc endpoint: one address across a chain's handover, with real HTTP servers on loopback (no mocks)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hpc.launch.endpoint import serve
from hpc.rundir import ChainDir, Endpoint, RunDir, write_json

pytestmark = pytest.mark.unit


class Upstream:
    """A frontend stand-in: answers with its name; `mode` draining answers 503 as a drained link's frontend."""

    def __init__(self, name: str) -> None:
        self.name, self.mode, self.served = name, "ok", 0
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/stream":
                    return self._stream()
                if upstream.mode == "draining":
                    return self._send(503, {"error": "draining"})
                upstream.served += 1
                self._send(200, {"served_by": upstream.name, "echo": json.loads(body)})

            def _send(self, status: int, data: dict) -> None:
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(3):
                    event = f"data: {json.dumps({'i': i, 't': time.monotonic()})}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    time.sleep(0.3)
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _chain(tmp_path: Path, links: int) -> ChainDir:
    chain = ChainDir(tmp_path / "chain")
    write_json(chain.path / ChainDir.RECORD, {"links": links, "handover_s": 60})
    for k in range(1, links + 1):
        chain.link(k).path.mkdir(parents=True)
    return chain


def _serve(chain: ChainDir, link: int, url: str) -> None:
    write_json(chain.link(link).layout.endpoint("frontend"), Endpoint("127.0.0.1", 1, url).to_json())
    write_json(chain.path / "serving.json", {"link": link, "job_id": str(40 + link), "at": time.time()})


@pytest.fixture
def endpoint():
    """Start `hpc endpoint` on a target in a thread of its own; yields a starter that returns its port."""
    loops = []

    def start(target: RunDir | ChainDir, retry_s: float = 5.0) -> int:
        ready = threading.Event()
        bound: list[int] = []
        loop = asyncio.new_event_loop()
        loops.append(loop)

        def run() -> None:
            asyncio.set_event_loop(loop)
            task = loop.create_task(serve(target, "127.0.0.1", 0, retry_s,
                                          lambda port, _e: (bound.append(port), ready.set())))
            try:
                loop.run_until_complete(task)
            except asyncio.CancelledError:
                pass

        threading.Thread(target=run, daemon=True).start()
        assert ready.wait(5)
        return bound[0]

    yield start
    for loop in loops:
        loop.call_soon_threadsafe(lambda lp=loop: [t.cancel() for t in asyncio.all_tasks(lp)])


def _post(conn: http.client.HTTPConnection, path: str = "/v1/completions", body: bytes | None = None,
          headers: dict | None = None) -> tuple[int, bytes]:
    raw = json.dumps({"prompt": "hi"}).encode() if body is None else body
    conn.request("POST", path, raw, headers or {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()


def test_a_handover_under_load_fails_no_request_and_moves_every_new_one(tmp_path, endpoint):
    first, second = Upstream("link-1"), Upstream("link-2")
    chain = _chain(tmp_path, 2)
    _serve(chain, 1, first.url)
    port = endpoint(chain)
    results: list[tuple[float, int, str]] = []
    stop = threading.Event()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # keep-alive, as SDKs pool them
        while not stop.is_set():
            sent = time.monotonic()
            status, body = _post(conn)
            results.append((sent, status, json.loads(body).get("served_by", body.decode())))

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    _serve(chain, 2, second.url)  # link 2 passed its checks: it names itself
    switched = time.monotonic()
    time.sleep(0.3)
    first.mode = "draining"  # link 1 drains: a request that still reached it would get a 503
    time.sleep(0.3)
    first.stop()  # and ends
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(10)

    assert [r for r in results if r[1] != 200] == []
    assert first.served > 50 and second.served > 50
    # a stat per request: nothing sent after the switch went to the link before it
    late = [r for r in results if r[0] > switched + 0.01 and r[2] == "link-1"]
    assert late == []


def test_a_stream_is_relayed_as_it_comes_and_keep_alive_survives_it(tmp_path, endpoint):
    up = Upstream("link-1")
    chain = _chain(tmp_path, 1)
    _serve(chain, 1, up.url)
    conn = http.client.HTTPConnection("127.0.0.1", endpoint(chain), timeout=10)
    conn.request("POST", "/stream", b"{}", {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
    first = response.readline()
    got_first = time.monotonic()
    assert json.loads(first.removeprefix(b"data: "))["i"] == 0
    rest = response.read()
    assert rest.count(b"data: ") == 2
    # the first event arrived while the upstream was still writing the others (0.3 s apart): not buffered
    assert time.monotonic() - got_first > 0.4
    assert _post(conn)[0] == 200  # the same connection goes on


def test_a_plain_run_is_served_too(tmp_path, endpoint):
    up = Upstream("solo")
    run = RunDir(tmp_path / "run")
    write_json(run.layout.endpoint("frontend"), Endpoint("127.0.0.1", 1, up.url).to_json())
    conn = http.client.HTTPConnection("127.0.0.1", endpoint(run), timeout=10)
    status, body = _post(conn)
    assert status == 200 and json.loads(body)["served_by"] == "solo"


def test_hostile_requests_get_a_400_and_nothing_serving_a_503_naming_the_chain(tmp_path, endpoint):
    chain = _chain(tmp_path, 2)
    port = endpoint(chain, retry_s=0.5)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    t0 = time.monotonic()
    status, body = _post(conn)
    assert status == 503 and "no job of chain serves yet" in json.loads(body)["error"]["message"]
    assert 0.5 <= time.monotonic() - t0 < 3

    for raw in (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                b"GARBAGE\r\n\r\n",
                b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 70_000 + b"\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(raw)
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 400 "), raw[:40]
