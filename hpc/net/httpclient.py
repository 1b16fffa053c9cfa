"""A small keep-alive HTTP/1.1 client on an asyncio Protocol: cheap enough to load a server from the same box.

A response's bytes are parsed in the loop's callback as they arrive (its head, then its body, chunked or by
length) and handed to the caller's `on_piece` there: no coroutine is resumed per read. With a stream reader, each
streamed token cost three awaits and a generator's resumption in the load generator (client_tokens.py)."""

from __future__ import annotations

import asyncio
from typing import Callable, cast
from urllib.parse import urlsplit


class _Response:
    """One response being read: `on_piece` gets the body's data as it arrives (all the chunks one read brought, as
    one piece); `done` gets the status once the body ended, or the exception that stopped it."""

    def __init__(self, on_piece: Callable[[bytes], None], done: asyncio.Future) -> None:
        self.on_piece, self.done = on_piece, done
        self.buffer = b""
        self.status = 0
        self.in_head = True
        self.chunked = False
        self.remaining = 0  # a body by length: bytes still to come
        self.close_after = False

    def feed(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        if self.in_head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buf
                return
            self._head(buf[:end].decode("latin-1"))
            buf = buf[end + 4:]
        if self.chunked:
            self._chunks(buf)
            return
        body, self.buffer = buf[:self.remaining], b""
        self.remaining -= len(body)
        if body:
            self.on_piece(body)
        if self.remaining == 0:
            self.done.set_result(self.status)

    def _head(self, text: str) -> None:
        lines = text.split("\r\n")
        self.status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        self.in_head = False
        self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self.remaining = int(headers.get("content-length", "0"))
        self.close_after = headers.get("connection", "").lower() == "close"

    def _chunks(self, buf: bytes) -> None:
        pieces, pos, ended = [], 0, False
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:  # the last chunk, then trailers (none, here) and an empty line
                end = buf.find(b"\r\n\r\n", eol)
                if end >= 0:
                    pos, ended = end + 4, True
                break
            end = eol + 2 + size
            if len(buf) < end + 2:
                break
            pieces.append(buf[eol + 2:end])
            pos = end + 2
        self.buffer = buf[pos:]
        if pieces:
            self.on_piece(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if ended:
            self.done.set_result(self.status)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport  # set by connection_made, before any other call
        self.response: _Response | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection's transports are Transports

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.done.done():
            return  # nothing asked: a server's stray bytes
        try:
            response.feed(data)
        except Exception as exc:  # noqa: BLE001 - the caller's on_piece or a malformed response: the caller's error
            if not response.done.done():
                response.done.set_exception(exc)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        response = self.response
        if response is not None and not response.done.done():
            response.done.set_exception(exc or ConnectionError("the server closed the connection mid-response"))


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.protocol: _Protocol | None = None

    @property
    def usable(self) -> bool:
        return self.protocol is not None and not self.protocol.lost

    async def open(self) -> _Protocol:
        _, self.protocol = await asyncio.get_running_loop().create_connection(_Protocol, self.host, self.port)
        return self.protocol

    def close(self) -> None:
        if self.protocol is not None:
            self.protocol.transport.close()
        self.protocol = None

    async def stream(self, method: str, path: str, body: bytes, on_piece: Callable[[bytes], None]) -> int:
        """Send a request; the response's body goes to `on_piece` as it arrives (in the loop's callback); returns
        its status once the body ended. A failure on the way (the connection lost, `on_piece` raising, a
        cancel) leaves the connection closed."""
        protocol = self.protocol if self.usable and self.protocol is not None else await self.open()
        done = asyncio.get_running_loop().create_future()
        protocol.response = response = _Response(on_piece, done)
        head = (f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        protocol.transport.write(head + body)
        try:
            status = await done
        except BaseException:
            self.close()
            raise
        finally:
            protocol.response = None
        if response.close_after:
            self.close()
        return status

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        parts: list[bytes] = []
        status = await self.stream(method, path, body, parts.append)
        return status, b"".join(parts)


class Pool:
    """One connection per concurrent user; a broken connection is replaced."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.idle: list[Connection] = []

    def take(self) -> Connection:
        return self.idle.pop() if self.idle else Connection(self.host, self.port)

    def give(self, conn: Connection, ok: bool) -> None:
        if ok and conn.usable:
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for c in self.idle:
            c.close()
        self.idle.clear()
