"""HTTP/1.1 on asyncio.Protocol with httptools (llhttp, the parser Node.js ships) doing the parsing.

What the server owes its clients, after uvicorn's `protocols/http/httptools_impl.py`: keep-alive and pipelining,
chunked request bodies, `Expect: 100-continue`, HTTP/1.0 (no chunked replies; close unless asked to keep alive),
HEAD without a body, 400 on malformed framing (duplicate Content-Length, Content-Length with Transfer-Encoding),
431/413 on oversize headers/bodies, timeouts for headers (slowloris), bodies (a lying Content-Length) and idle
keep-alive connections, 503 + Retry-After when the server holds its maximum of requests, backpressure on slow
readers, and cancellation of the handler (and the engine work behind it) when the client disconnects. An error
after a streamed response started ends the stream (an SSE `error` event for event streams), never a status line.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, cast
from urllib.parse import parse_qs, urlsplit

import httptools
import msgspec

log = logging.getLogger(__name__)

_UNSENT_CHUNKS = 64  # a stream's chunks held for one send at most (_send_soon)


def _no_calls(change: int) -> None:
    pass


def _nothing() -> None:
    pass


REASONS = {100: "Continue", 200: "OK", 204: "No Content", 400: "Bad Request", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 413: "Payload Too Large", 417: "Expectation Failed",
           422: "Unprocessable Entity", 431: "Request Header Fields Too Large", 499: "Client Closed Request",
           500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
MAX_PIPELINED = 16  # parsed requests waiting behind the current one before the server stops reading


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 64 * 1024 * 1024
    header_timeout_s: float = 10.0  # first byte of a request -> end of its headers
    body_timeout_s: float = 30.0  # longest silence while a request body is arriving
    keepalive_timeout_s: float = 15.0  # an idle connection between requests
    max_concurrent: int = 4096  # requests in handlers at once (GET probes are always answered)
    retry_after_s: int = 1


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.target).query)


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    stream: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response]]


def error_body(status: int, message: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ('{"error":{"message":"%s","type":"%s","code":%d}}' % (message, kind, status)).encode()


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Parsed:
    request: Request
    http10: bool
    keep_alive: bool


class _Server:
    """State shared by the connections of one server: the handler, limits and the count of requests in flight."""

    def __init__(self, handler: Handler, limits: HttpLimits) -> None:
        self.handler = handler
        self.limits = limits
        self.active = 0
        self.connections: set[_Protocol] = set()
        self.on_close: Callable[[], None] = _nothing  # a frontend group's dealer counts each process's connections
        self.on_activity: Callable[[int], None] = _no_calls  # a POST's start (+1) and end (-1): IdleSpin.calls


class _Protocol(asyncio.Protocol):
    def __init__(self, server: _Server) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport  # set by connection_made, before any other call
        self.pending: deque[_Parsed] = deque()  # pipelined requests behind the one being answered
        self.current: asyncio.Task | None = None
        self.closed = False
        self.busy = False  # a request is being answered
        self.reading = True
        self.writable = asyncio.Event()
        self.writable.set()
        self.timer: asyncio.TimerHandle | None = None
        self.deadline: float | None = None
        self.deadline_status: int | None = None
        # a stream's chunks made in one turn of the loop, sent together at its end (_send_soon)
        self._unsent: list[bytes] = []
        self._reset_message()

    # ---- connection ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_server's transports are Transports
        self.server.connections.add(self)
        self._arm(self.limits.keepalive_timeout_s, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.server.on_close()
        self._stop_timer()
        self.writable.set()
        if self.current is not None:
            self.current.cancel()  # the client is gone: stop its request (and the engine work behind it)
        self.pending.clear()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        try:  # a new message's first byte replaces the idle timer with the header timer (on_message_begin)
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            reject = exc.__context__
            if isinstance(reject, _Reject):
                self._fail(reject.status, str(reject))
            else:
                log.exception("HTTP parser callback failed")
                self._fail(400, "malformed request")
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._fail(400, f"malformed request: {exc}".replace('"', "'"))

    # ---- timers ----------------------------------------------------------------------------------
    # One lazy timer per connection: arming moves a deadline (two stores), and the timer, when it fires, re-arms
    # itself at the deadline if that moved. Per-request call_later/cancel pairs cost a third of the throughput.
    def _arm(self, seconds: float, status: int | None) -> None:
        self.deadline = self.loop.time() + seconds
        self.deadline_status = status
        if self.timer is not None and self.timer.when() > self.deadline:
            self.timer.cancel()
            self.timer = None
        if self.timer is None:
            self.timer = self.loop.call_at(self.deadline, self._expired)

    def _disarm(self) -> None:
        self.deadline = None

    def _stop_timer(self) -> None:
        self.deadline = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        if self.closed or self.deadline is None:
            return
        if self.loop.time() < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._expired)
            return
        if self.deadline_status is None:  # idle keep-alive: nothing to say, just close
            self.transport.close()
        else:
            self._fail(self.deadline_status, "request timed out")

    # ---- parser callbacks (httptools) ------------------------------------------------------------
    def _reset_message(self) -> None:
        self.url = b""
        self.header_list: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.body = bytearray()
        self.in_headers = False
        self.body_started = False

    def on_message_begin(self) -> None:
        self._reset_message()
        self.in_headers = True
        self._arm(self.limits.header_timeout_s, 408)

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_header(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_list.append((name, value))
        self._count_header(len(name) + len(value) + 4)

    def _count_header(self, size: int) -> None:
        self.header_bytes += size
        if self.header_bytes > self.limits.max_header_bytes:
            raise _Reject(431, "request headers too large")

    def on_headers_complete(self) -> None:
        self.in_headers = False
        headers: dict[str, str] = {}
        for raw_name, raw_value in self.header_list:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1").strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self.headers = headers
        length = headers.get("content-length")
        if length is not None and int(length) > self.limits.max_body_bytes:
            raise _Reject(413, "request body too large")
        expect = headers.get("expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                raise _Reject(417, "only 'Expect: 100-continue' is supported")
            if self.parser.get_http_version() == "1.1":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.body_started = True
        self._arm(self.limits.body_timeout_s, 408)

    def on_body(self, body: bytes) -> None:
        self.body += body
        if len(self.body) > self.limits.max_body_bytes:
            raise _Reject(413, "request body too large")
        self._arm(self.limits.body_timeout_s, 408)  # the timeout is for silence, not for the whole body

    def on_message_complete(self) -> None:
        self._disarm()
        method = self.parser.get_method().decode("ascii")
        request = Request(method, self.url.decode("latin-1"), self.headers, bytes(self.body))
        self.pending.append(_Parsed(request, self.parser.get_http_version() == "1.0",
                                    self.parser.should_keep_alive()))
        self._reset_message()
        if not self.busy:
            self._start_next()
        elif len(self.pending) >= MAX_PIPELINED and self.reading:
            self.reading = False
            self.transport.pause_reading()

    # ---- answering -------------------------------------------------------------------------------
    def _fail(self, status: int, message: str) -> None:
        """An error before any answer to this request started: the status line, then close."""
        if self.closed:
            return
        body = error_body(status, message)
        self.transport.write(_head(status, "application/json", {"content-length": str(len(body)),
                                                                "connection": "close"}, False) + body)
        self.transport.close()

    def _start_next(self) -> None:
        parsed = self.pending.popleft()
        self.busy = True
        self.current = self.loop.create_task(self._respond(parsed))
        self.current.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task) -> None:
        self.busy = False
        self.current = None
        if self.closed or task.cancelled():
            return
        if task.exception() is not None:
            log.error("answering a request failed", exc_info=task.exception())
            self.transport.close()
            return
        if not task.result():
            self.transport.close()
            return
        if not self.reading and len(self.pending) < MAX_PIPELINED // 2:
            self.reading = True
            self.transport.resume_reading()
        if self.pending:
            self._start_next()
        elif not self.in_headers and not self.body_started:
            self._arm(self.limits.keepalive_timeout_s, None)

    async def _respond(self, parsed: _Parsed) -> bool:
        """Answer one request; whether the connection stays open for the next."""
        request, server = parsed.request, self.server
        # a request, not a probe of /health or /metrics: it counts towards the limit and starts an idle spin
        serving = request.method != "GET" and request.method != "HEAD"
        if serving and server.active >= self.limits.max_concurrent:
            body = error_body(503, "the server is at its limit of concurrent requests; retry shortly")
            self.transport.write(_head(503, "application/json", {
                "content-length": str(len(body)), "retry-after": str(self.limits.retry_after_s)}, parsed.http10) + body)
            return parsed.keep_alive
        server.active += 1
        if serving:
            server.on_activity(1)
        try:
            return await self._respond_with_handler(parsed)
        finally:
            server.active -= 1
            if serving:
                server.on_activity(-1)

    async def _respond_with_handler(self, parsed: _Parsed) -> bool:
        request = parsed.request
        # HEAD is GET without the body (RFC 9110): clients such as AIPerf probe /metrics with it, and a body
        # after a HEAD answer would be read as the start of the next response on a kept-alive connection.
        head = request.method == "HEAD"
        if head:
            request = Request("GET", request.target, request.headers, request.body)
        try:
            response = await self.server.handler(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed for %s %s", request.method, request.target)
            self._fail(500, "internal error")
            return False
        if self.closed:
            return False
        keep = parsed.keep_alive
        extra = dict(response.headers)
        if parsed.http10 and keep:
            extra["connection"] = "keep-alive"
        elif not keep:
            extra["connection"] = "close"
        if response.stream is None:
            extra["content-length"] = str(len(response.body))
            head_bytes = _head(response.status, response.content_type, extra, parsed.http10)
            self.transport.write(head_bytes if head else head_bytes + response.body)  # one send, not two
            return keep
        stream = response.stream
        if parsed.http10:  # no chunked coding in HTTP/1.0: the body ends when the connection closes
            extra["connection"] = "close"
            keep = False
        else:
            extra["transfer-encoding"] = "chunked"
        extra.setdefault("cache-control", "no-cache")
        self.transport.write(_head(response.status, response.content_type, extra, parsed.http10))
        try:
            if not head:
                await self._write_stream(stream, response.content_type, chunked=not parsed.http10)
        except _StreamAborted:
            return False
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        return keep

    async def _write_stream(self, stream: AsyncIterator[bytes], content_type: str, chunked: bool) -> None:
        def frame(chunk: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk

        try:
            async for chunk in stream:
                if self.closed:
                    raise _StreamAborted
                if chunk:
                    self._send_soon(frame(chunk))
                    if not self.writable.is_set():  # a slow reader: wait instead of buffering without bound
                        await self.writable.wait()
        except (asyncio.CancelledError, _StreamAborted):
            self._send_unsent()
            raise
        except Exception:
            log.exception("stream failed after the response started")
            self._send_unsent()
            if not self.closed:
                if content_type.startswith("text/event-stream"):
                    event = b'event: error\ndata: {"error":{"message":"internal error","type":"server_error",' \
                            b'"code":500}}\n\n'
                    self.transport.write(frame(event))
                    if chunked:
                        self.transport.write(b"0\r\n\r\n")
                self.transport.close()  # other bodies: an incomplete chunked body tells the client
            raise _StreamAborted from None
        self._send_unsent()
        if chunked and not self.closed:
            self.transport.write(b"0\r\n\r\n")

    def _send_soon(self, data: bytes) -> None:
        """Send at the end of this turn of the loop, with whatever else this stream makes in it: a loop behind
        its workers finds several of a request's outputs waiting and makes their chunks back to back, and one
        send for them all spares a system call each (the send was a third of a frontend's time, py-spy)."""
        if not self._unsent:
            self.loop.call_soon(self._send_unsent)
        self._unsent.append(data)
        if len(self._unsent) >= _UNSENT_CHUNKS:  # a source that never waits: send as it goes, and see backpressure
            self._send_unsent()

    def _send_unsent(self) -> None:
        if not self._unsent:
            return
        data = self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent)
        self._unsent.clear()
        if not self.closed:
            self.transport.write(data)


class _StreamAborted(Exception):
    pass


def _head(status: int, content_type: str, extra: dict[str, str], http10: bool) -> bytes:
    lines = [f"HTTP/1.{0 if http10 else 1} {status} {REASONS.get(status, 'Status')}", f"content-type: {content_type}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HttpServer:
    def __init__(self, handler: Handler, limits: HttpLimits | None = None,
                 on_activity: Callable[[int], None] = _no_calls) -> None:
        self.state = _Server(handler, limits or HttpLimits())
        self.state.on_activity = on_activity
        self.server: asyncio.base_events.Server | None = None
        self._adopting: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Protocol(self.state), host, port,
                                               reuse_address=True, backlog=1024)

    def adopt(self, sock: socket.socket) -> None:
        """Serve a connection accepted elsewhere (a frontend group's dealer: by this process, or passed to it)."""
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(lambda: _Protocol(self.state), sock))
        self._adopting.add(task)  # held until the transport exists: a pending task is only weakly referenced
        task.add_done_callback(lambda done: self._adopted(done, sock))

    def _adopted(self, task: asyncio.Task, sock: socket.socket) -> None:
        self._adopting.discard(task)
        if task.cancelled() or task.exception() is not None:  # never served: closed, and counted as closed
            log.debug("connection not adopted: %s", "cancelled" if task.cancelled() else task.exception())
            sock.close()
            self.state.on_close()

    @property
    def port(self) -> int:
        if self.server is None:
            raise RuntimeError("the HTTP server is not listening yet")
        return self.server.sockets[0].getsockname()[1]

    @property
    def connections(self) -> int:
        return len(self.state.connections)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for conn in list(self.state.connections):
            if not conn.busy:
                conn.transport.close()


json_dumps = msgspec.json.encode
json_loads = msgspec.json.decode  # a msgspec.DecodeError is a ValueError


def json_response(data: object, status: int = 200) -> Response:
    return Response(status=status, body=json_dumps(data))
