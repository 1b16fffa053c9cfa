"""Frontend <-> worker request plane: multiplexed request/stream RPC over one TCP connection per peer.

Frame: 8-byte header (JSON length, binary length, both u32 big-endian), JSON body, binary payload.
Client -> server: {"id", "op", "body"} or {"id", "op": "cancel"}.
Server -> client: {"id", "body"?, "end": bool, "error"?: str, "code"?: int}.
A dropped connection fails every stream on it at once: that is how a dead worker is noticed first.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import struct
from typing import Any, AsyncIterator, Callable

try:  # orjson is faster; the standard library is enough
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    _loads = orjson.loads
except ImportError:  # pragma: no cover
    import json

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">II")
MAX_FRAME = 1 << 30


class RemoteError(Exception):
    """The peer answered with an error (code 400 = the request's fault, else the peer's)."""

    def __init__(self, message: str, code: int = 500) -> None:
        super().__init__(message)
        self.code = code


class PeerGone(ConnectionError):
    """The connection to the peer dropped before the stream ended."""


def encode_frame(msg: dict[str, Any], payload: bytes = b"") -> bytes:
    body = _dumps(msg)
    return _HEADER.pack(len(body), len(payload)) + body + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    header = await reader.readexactly(_HEADER.size)
    n_json, n_bin = _HEADER.unpack(header)
    if n_json + n_bin > MAX_FRAME:
        raise ConnectionError("frame too large")
    body = await reader.readexactly(n_json)
    payload = await reader.readexactly(n_bin) if n_bin else b""
    return _loads(body), payload


_DEADLINE = object()  # queued by a call's deadline timer

# A stream handler yields (body, payload) pairs; the last one ends the stream.
StreamHandler = Callable[[dict[str, Any], bytes], AsyncIterator[tuple[dict[str, Any], bytes]]]


HELLO_TIMEOUT_S = 5.0


class RpcServer:
    """Serves streamed calls; with a token, a connection must open with {"op": "hello", "token": ...} or it is
    closed before anything runs (the job's workers listen on their node's address)."""

    def __init__(self, handlers: dict[str, StreamHandler], token: str | None = None) -> None:
        self.handlers = handlers
        self.token = token
        self.refused = 0
        self.server: asyncio.base_events.Server | None = None
        self.inflight = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port, reuse_address=True)

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        streams: dict[int, asyncio.Task] = {}
        try:
            if self.token is not None:
                try:
                    hello, _ = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
                except (asyncio.TimeoutError, ValueError, TypeError):
                    hello = {}
                token = hello.get("token") if isinstance(hello, dict) and hello.get("op") == "hello" else None
                if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
                    self.refused += 1
                    log.warning("refused an RPC connection without the job's token")
                    return
            while True:
                msg, payload = await read_frame(reader)
                sid = msg["id"]
                if msg.get("op") == "cancel":
                    task = streams.pop(sid, None)
                    if task:
                        task.cancel()
                    continue
                task = asyncio.create_task(self._run(sid, msg, payload, writer, streams))
                streams[sid] = task
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for task in streams.values():  # the client went away: cancel its engine requests
                task.cancel()
            writer.close()

    async def _run(self, sid: int, msg: dict[str, Any], payload: bytes, writer: asyncio.StreamWriter,
                   streams: dict[int, asyncio.Task]) -> None:
        handler = self.handlers.get(msg.get("op", ""))
        self.inflight += 1
        try:
            if handler is None:
                raise RemoteError(f"unknown op {msg.get('op')!r}", 400)
            async for body, data in handler(msg.get("body") or {}, payload):
                writer.write(encode_frame({"id": sid, "body": body, "end": False}, data))
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    await writer.drain()
            writer.write(encode_frame({"id": sid, "end": True}))
        except asyncio.CancelledError:
            pass
        except RemoteError as exc:
            writer.write(encode_frame({"id": sid, "end": True, "error": str(exc), "code": exc.code}))
        except ValueError as exc:  # bad request content (pydantic errors are ValueErrors)
            writer.write(encode_frame({"id": sid, "end": True, "error": str(exc), "code": 400}))
        except Exception as exc:
            log.exception("handler %s failed", msg.get("op"))
            writer.write(encode_frame({"id": sid, "end": True, "error": f"{type(exc).__name__}: {exc}",
                                       "code": 500}))
        finally:
            self.inflight -= 1
            streams.pop(sid, None)


class RpcClient:
    """One connection to one peer, shared by every request to it."""

    def __init__(self, host: str, port: int, on_lost: Callable[["RpcClient"], None] | None = None,
                 token: str | None = None) -> None:
        self.host, self.port = host, port
        self.token = token
        self.on_lost = on_lost
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.alive = True

    async def connect(self, timeout: float = 5.0) -> None:
        reader, self._writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), timeout)
        if self.token is not None:
            self._writer.write(encode_frame({"op": "hello", "token": self.token}))
        self._reader_task = asyncio.create_task(self._read(reader))

    @property
    def connected(self) -> bool:
        return self._writer is not None and self.alive

    async def _ensure(self) -> None:
        if self._writer is None:
            async with self._lock:
                if self._writer is None:
                    await self.connect()
        if not self.alive:
            raise PeerGone(f"{self.host}:{self.port} is gone")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg, payload = await read_frame(reader)
                queue = self._queues.get(msg["id"])
                if queue is not None:
                    queue.put_nowait((msg, payload))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.alive = False
            for queue in self._queues.values():
                queue.put_nowait(None)
            if self.on_lost:
                self.on_lost(self)

    async def stream(self, op: str, body: dict[str, Any], payload: bytes = b"",
                     deadline: float | None = None) -> AsyncIterator[tuple[dict, bytes]]:
        """Frames of one call; past `deadline` (event-loop time) asyncio.TimeoutError, and the server is told to
        cancel. The deadline is a timer that drops a marker in the queue: nothing is paid per frame."""
        await self._ensure()
        sid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[sid] = queue
        finished = False
        timer = asyncio.get_running_loop().call_at(deadline, queue.put_nowait, _DEADLINE) if deadline else None
        try:
            self._writer.write(encode_frame({"id": sid, "op": op, "body": body}, payload))
            while True:
                item = await queue.get()
                if item is None:
                    raise PeerGone(f"connection to {self.host}:{self.port} lost")
                if item is _DEADLINE:
                    raise asyncio.TimeoutError(f"{op} on {self.host}:{self.port} passed its deadline")
                msg, data = item
                if msg.get("error"):
                    finished = True
                    raise RemoteError(msg["error"], msg.get("code", 500))
                if msg.get("end"):
                    finished = True
                    return
                yield msg["body"], data
        finally:
            if timer is not None:
                timer.cancel()
            self._queues.pop(sid, None)
            if not finished and self.alive and self._writer is not None:
                self._writer.write(encode_frame({"id": sid, "op": "cancel"}))  # caller stopped early

    async def call(self, op: str, body: dict[str, Any], payload: bytes = b"") -> tuple[dict, bytes]:
        result: tuple[dict, bytes] = ({}, b"")
        async for item in self.stream(op, body, payload):
            result = item
        return result

    async def close(self) -> None:
        self.alive = False
        if self._writer is not None:
            self._writer.close()
        if self._reader_task:
            self._reader_task.cancel()


