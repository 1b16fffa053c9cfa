"""`hpc endpoint RUN`: one address for a run, and for a chain of jobs across its handovers (hpc.launch.chain).

An HTTP/1.1 forwarder on the standard library alone (it runs on a login node, where only the launcher is
installed). Each request goes to the frontend of the job serving now, read again from the run directory when it
changed, on a connection of its own; the answer is relayed as it arrives, so streams stay streams. A request is
sent again, to the job serving by then, when it failed before any byte of its answer came back: the job it was
sent to was ending (refused, reset, a 503 from a link that has handed over). After the first byte nothing is
retried: the client has part of an answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from hpc.rundir import ChainDir, RunDir

log = logging.getLogger("hpc.endpoint")

MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 1024 * 1024
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade"}


class Retry(Exception):
    """The request can go again: nothing of its answer reached the client."""


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes

    def wants_close(self) -> bool:
        value = next((v.lower() for k, v in self.headers if k.lower() == "connection"), "")
        return "close" in value or (self.version == "HTTP/1.0" and "keep-alive" not in value)

    def head_for(self, host: str) -> bytes:
        kept = [(k, v) for k, v in self.headers if k.lower() not in HOP_BY_HOP | {"host", "content-length"}]
        lines = [f"{self.method} {self.target} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in kept),
                 f"Content-Length: {len(self.body)}", "Connection: close"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Follow:
    """Where requests go now: the run's frontend, or the serving link's for a chain; a file is read again only when
    its modification time changed (a stat per request)."""

    def __init__(self, target: RunDir | ChainDir) -> None:
        self.target = target
        self._serving: int | None = None
        self._run: RunDir | None = target if isinstance(target, RunDir) else None
        self._seen: tuple[Path, int] | None = None
        self._url: str | None = None
        self._name = "-"

    def serving_name(self) -> str:
        """The run (a chain's link: CHAIN.K) requests go to now, for the answer's X-Hpc-Run header."""
        return self._name

    def url(self) -> str | None:
        if isinstance(self.target, ChainDir):
            stamp = _mtime(self.target.serving_path)
            if stamp != self._serving:
                self._serving = stamp
                serving = self.target.serving()
                self._run = self.target.link(serving["link"]) if serving else None
        if self._run is None:
            return None
        seen = (self._run.path, _mtime(self._run.layout.endpoint("frontend")))
        if seen != self._seen:
            self._seen, self._url, self._name = seen, self._run.frontend_url(), self._run.name
        return self._url


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return -1


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One request, or None at a clean end of the connection; ValueError for one that cannot be read."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise ValueError("the request ended inside its headers") from None
        return None
    except asyncio.LimitOverrunError:
        raise ValueError(f"request headers over {MAX_HEAD} bytes") from None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("not an HTTP/1.x request line")
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:] if line)]
    names = {k.lower(): v for k, v in headers}
    if "chunked" in names.get("transfer-encoding", "").lower():
        raise ValueError("a chunked request body: send its Content-Length")
    length = names.get("content-length", "0")
    if not length.isdigit() or int(length) > MAX_BODY:
        raise ValueError(f"Content-Length must be a number of bytes up to {MAX_BODY}")
    body = await reader.readexactly(int(length))
    return Request(parts[0], parts[1], parts[2], headers, body)


async def forward(request: Request, url: str, writer: asyncio.StreamWriter, close: bool, changed,
                  served_by: str) -> bool:
    """Send `request` to the frontend at `url` and relay its answer; True when the client connection must close.
    Retry before the answer's first byte reached the client."""
    where = urlsplit(url)
    try:
        up_reader, up_writer = await asyncio.open_connection(where.hostname, where.port or 80, limit=MAX_HEAD)
    except OSError as exc:
        raise Retry(f"cannot connect to {url}: {exc}") from None
    try:
        up_writer.write(request.head_for(where.netloc) + request.body)
        await up_writer.drain()
        try:
            head = await up_reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
            raise Retry(f"{url} closed before answering ({type(exc).__name__})") from None
        lines = head.decode("latin-1").split("\r\n")
        status = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else ""
        if status == "503" and changed():
            raise Retry(f"{url} answered 503 and another job serves now")
        headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:] if line)]
        names = {k.lower() for k, _ in headers}
        framed = "content-length" in names or "chunked" in dict((k.lower(), v) for k, v in headers).get(
            "transfer-encoding", "")
        close = close or not framed  # an answer that ends when its connection does
        kept = [(k, v) for k, v in headers if k.lower() not in {"connection", "keep-alive"}]
        out = [lines[0], *(f"{k}: {v}" for k, v in kept), f"X-Hpc-Run: {served_by}",
               f"Connection: {'close' if close else 'keep-alive'}"]
        writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))
        while chunk := await up_reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        return close
    finally:
        up_writer.close()


class Endpoint:
    def __init__(self, target: RunDir | ChainDir, retry_s: float = 30.0) -> None:
        self.follow, self.retry_s = Follow(target), retry_s
        self.name = target.path.name
        self.served = self.retried = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await read_request(reader)
                except ValueError as exc:
                    _answer(writer, 400, f"hpc endpoint: {exc}")
                    break
                if request is None or await self._one(request, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client left
        finally:
            writer.close()

    async def _one(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        deadline = time.monotonic() + self.retry_s
        why = f"no job of {self.name} serves yet"
        while time.monotonic() < deadline:
            url = self.follow.url()
            if url is None:
                await asyncio.sleep(0.2)
                continue
            try:
                close = await forward(request, url, writer, request.wants_close(), lambda: self.follow.url() != url,
                                      self.follow.serving_name())
            except Retry as exc:
                why = str(exc)
                self.retried += 1
                log.info("hpc endpoint: %s; sending %s %s again", why, request.method, request.target)
                await asyncio.sleep(0.1)
                continue
            self.served += 1
            return close
        _answer(writer, 503, f"hpc endpoint: {why} (after {self.retry_s:g} s)")
        return True


def _answer(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    import json

    body = json.dumps({"error": {"message": message, "type": "unavailable" if status == 503 else "bad_request",
                                 "code": status}}).encode()
    reason = {400: "Bad Request", 503: "Service Unavailable"}[status]
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + body)


async def serve(target: RunDir | ChainDir, host: str, port: int, retry_s: float = 30.0,
                started=None) -> None:
    endpoint = Endpoint(target, retry_s)
    server = await asyncio.start_server(endpoint.handle, host, port, limit=MAX_HEAD)
    bound = server.sockets[0].getsockname()[1]
    if started is not None:
        started(bound, endpoint)
    async with server:
        await server.serve_forever()
