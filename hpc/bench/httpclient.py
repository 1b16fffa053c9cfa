"""A small keep-alive HTTP/1.1 client on asyncio streams: cheap enough to load a server from the same box."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import urlsplit


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def _send(self, method: str, path: str, body: bytes) -> None:
        if self.writer is None:
            await self.open()
        head = (f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)

    async def _head(self) -> tuple[int, dict[str, str]]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        return status, headers

    async def chunks(self, method: str, path: str, body: bytes) -> AsyncIterator[tuple[int, bytes]]:
        """(status, piece) as the body arrives; chunked bodies piece by piece."""
        await self._send(method, path, body)
        status, headers = await self._head()
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await self.reader.readline()).strip() or b"0", 16)
                if size == 0:
                    await self.reader.readline()
                    break
                data = await self.reader.readexactly(size)
                await self.reader.readexactly(2)
                yield status, data
        else:
            yield status, await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            self.close()

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        parts = []
        status = 0
        async for status, piece in self.chunks(method, path, body):
            parts.append(piece)
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
        if ok and conn.writer is not None:
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for c in self.idle:
            c.close()
        self.idle.clear()
