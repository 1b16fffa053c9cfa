"""The load generator's HTTP client: responses parsed in the protocol's callback however the bytes arrive."""

from __future__ import annotations

import asyncio

import pytest

from hpc.net.httpclient import Connection, Pool

pytestmark = pytest.mark.unit

EVENTS = [b'data: {"choices":[{"text":"$(rm -rf /) `x` \'q\' \\"d\\""}]}\n\n', b"data: [DONE]\n\n"]
CHUNKED = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
           + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\nx-trailer: 1\r\n\r\n")
BY_LENGTH = b"HTTP/1.1 404 Not Found\r\ncontent-length: 13\r\nconnection: close\r\n\r\n{\"error\": 1}\n"


async def _serve(responses: list[tuple[bytes, int]]) -> tuple[asyncio.AbstractServer, int, list[bytes]]:
    """A server that answers the requests on one connection in turn, each response written `cut` bytes at a
    time (0: closes instead of the last byte); it records each request's body."""
    bodies: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for raw, cut in responses:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.startswith(b"content-length")))
            bodies.append(await reader.readexactly(length))
            if cut == 0:
                writer.write(raw[:-1])
                await writer.drain()
                writer.close()
                return
            for start in range(0, len(raw), cut):
                writer.write(raw[start:start + cut])
                await writer.drain()
                await asyncio.sleep(0)
        await reader.read()  # until the client closes
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], bodies


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_a_chunked_then_a_sized_response_on_one_connection_whatever_the_splits(cut):
    async def run():
        server, port, bodies = await _serve([(CHUNKED, cut), (BY_LENGTH, cut)])
        conn = Connection("127.0.0.1", port)
        pieces: list[bytes] = []
        status = await conn.stream("POST", "/v1/completions", b'{"a": "$(x)"}', pieces.append)
        assert status == 200 and b"".join(pieces) == b"".join(EVENTS) and conn.usable  # kept alive
        assert len(pieces) <= len(EVENTS)  # one piece per read at most, never one per byte of a chunk
        first = conn.protocol
        status, body = await conn.request("GET", "/health")
        assert conn.protocol is None and not conn.usable  # the server said connection: close
        assert first is not None and (status, body) == (404, b'{"error": 1}\n')
        assert bodies == [b'{"a": "$(x)"}', b""]
        server.close()
    asyncio.run(run())


def test_a_response_cut_short_fails_the_call_and_the_pool_replaces_the_connection():
    async def run():
        server, port, _ = await _serve([(CHUNKED, 0)])
        pool = Pool(f"http://127.0.0.1:{port}")
        conn = pool.take()
        with pytest.raises(ConnectionError):
            await conn.stream("POST", "/", b"{}", lambda piece: None)
        pool.give(conn, True)  # even if told it went well: a lost connection is not kept
        assert pool.idle == [] and pool.take() is not conn
        server.close()
    asyncio.run(run())


def test_an_error_in_the_callers_parser_reaches_the_caller_and_closes_the_connection():
    async def run():
        server, port, _ = await _serve([(CHUNKED, 5)])
        conn = Connection("127.0.0.1", port)

        def parse(piece: bytes) -> None:
            raise ValueError("not JSON")
        with pytest.raises(ValueError, match="not JSON"):
            await conn.stream("POST", "/", b"{}", parse)
        assert not conn.usable
        server.close()
    asyncio.run(run())
