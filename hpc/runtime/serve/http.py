"""A small, fast HTTP/1.1 server on asyncio.Protocol: keep-alive, chunked streaming, and cancellation of
the handler when the client disconnects. Used by the frontend and by each worker's /health + /metrics.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)
MAX_HEADER = 64 * 1024
REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 413: "Payload Too Large", 422: "Unprocessable Entity",
           499: "Client Closed Request", 500: "Internal Server Error", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout"}


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


class _Protocol(asyncio.Protocol):
    def __init__(self, handler: Handler, max_body: int) -> None:
        self.handler = handler
        self.max_body = max_body
        self.buffer = bytearray()
        self.requests: asyncio.Queue[Request | None] = asyncio.Queue()
        self.transport: asyncio.Transport | None = None
        self.worker: asyncio.Task | None = None
        self.current: asyncio.Task | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.worker = asyncio.get_running_loop().create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.current is not None:
            self.current.cancel()  # the client is gone: stop its request (and the engine work behind it)
        self.requests.put_nowait(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEADER:
                    self._fail(400, "headers too large")
                return
            try:
                head = bytes(self.buffer[:end]).decode("latin-1")
                lines = head.split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    key, _, value = line.partition(":")
                    headers[key.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._fail(400, "malformed request")
                return
            if length > self.max_body:
                self._fail(413, "request body too large")
                return
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            self.requests.put_nowait(Request(method, target, headers, body))

    def _fail(self, status: int, message: str) -> None:
        body = ('{"error":{"message":"%s","type":"invalid_request_error","code":%d}}' % (message, status)).encode()
        self._write_head(status, "application/json", {"content-length": str(len(body)), "connection": "close"})
        self.transport.write(body)
        self.transport.close()

    def _write_head(self, status: int, content_type: str, extra: dict[str, str]) -> None:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", f"content-type: {content_type}"]
        lines += [f"{k}: {v}" for k, v in extra.items()]
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    async def _serve(self) -> None:
        while True:
            request = await self.requests.get()
            if request is None or self.closed:
                return
            self.current = asyncio.current_task()
            try:
                await self._respond(request)
            except asyncio.CancelledError:
                if not self.closed:
                    raise
                return
            except Exception:
                log.exception("handler failed for %s %s", request.method, request.target)
                if not self.closed:
                    self._fail(500, "internal error")
                return
            finally:
                self.current = None
            if request.headers.get("connection", "").lower() == "close":
                self.transport.close()
                return

    async def _respond(self, request: Request) -> None:
        # HEAD is GET without the body (RFC 9110): clients such as AIPerf probe /metrics with it, and a body
        # after a HEAD answer would be read as the start of the next response on a kept-alive connection.
        head = request.method == "HEAD"
        response = await self.handler(replace(request, method="GET") if head else request)
        if self.closed:
            return
        extra = dict(response.headers)
        if response.stream is None:
            extra["content-length"] = str(len(response.body))
            self._write_head(response.status, response.content_type, extra)
            if not head:
                self.transport.write(response.body)
            return
        extra["transfer-encoding"] = "chunked"
        extra.setdefault("cache-control", "no-cache")
        self._write_head(response.status, response.content_type, extra)
        stream = response.stream
        if head:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
            return
        try:
            async for chunk in stream:
                if self.closed:
                    break
                if chunk:
                    self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        if not self.closed:
            self.transport.write(b"0\r\n\r\n")


class HttpServer:
    def __init__(self, handler: Handler, max_body: int = 64 * 1024 * 1024) -> None:
        self.handler = handler
        self.max_body = max_body
        self.server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Protocol(self.handler, self.max_body), host, port,
                                               reuse_address=True, backlog=1024)

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


def json_response(data: object, status: int = 200) -> Response:
    from hpc.runtime.serve.rpc import _dumps

    return Response(status=status, body=_dumps(data))
