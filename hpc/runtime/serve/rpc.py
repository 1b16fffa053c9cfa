"""Frontend <-> worker request plane: multiplexed request/stream RPC over one TCP connection per peer.

Frames and messages are the typed ones of hpc.runtime.serve.wire: the client sends `Call(id, body)` (the body's
tag names the operation), the server answers `Reply(id, body?, end, error?, code)` frames. A dropped connection
fails every stream on it at once: that is how a dead worker is noticed first.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import itertools
import logging
from typing import AsyncGenerator, AsyncIterator, Callable, cast

from hpc.runtime.serve.wire import (
    BIG_PAYLOAD, HEADER, MAX_FRAME, REPLIES_FRAME, Call, CallBody, Cancel, DecodeError, GenerateOutput, Hello, Reply,
    ReplyBody, call_id, decode_call, decode_replies, decode_reply, encode_frame, encode_replies, frame_parts,
)

log = logging.getLogger(__name__)


def _named(body: object) -> str:
    """A call as the logs name it: its request's id where it has one."""
    rid = getattr(body, "request_id", None)
    return f"{rid} ({type(body).__name__})" if rid else type(body).__name__


KV_TRANSFER_TIMEOUT = 504  # a decode's RemoteError code when the prefill's KV did not arrive within its deadline
KV_GONE = 404  # a prefill's when no KV waits under the handle (taken by a decode that then died, or expired)


class RemoteError(Exception):
    """The peer answered with an error (code 400 = the request's fault, else the peer's)."""

    def __init__(self, message: str, code: int = 500) -> None:
        super().__init__(message)
        self.code = code


class PeerGone(ConnectionError):
    """The connection to the peer dropped before the stream ended."""


async def _read_raw(reader: asyncio.StreamReader) -> tuple[bytes, bytes | None]:
    """A frame's body and payload; None for the payload of a frame of replies (wire.REPLIES_FRAME)."""
    n_body, n_payload = HEADER.unpack(await reader.readexactly(HEADER.size))
    replies = n_payload == REPLIES_FRAME
    if n_body + (0 if replies else n_payload) > MAX_FRAME:
        raise ConnectionError("frame too large")
    body = await reader.readexactly(n_body)
    if replies:
        return body, None
    if n_payload < BIG_PAYLOAD:
        return body, (await reader.readexactly(n_payload) if n_payload else b"")
    # readexactly would grow the reader's own buffer to the whole payload (reallocations and copies of hundreds
    # of MB); chunks into one buffer keep the reader's buffer small. A bytearray: unpacking needs no copy.
    payload = bytearray(n_payload)
    view, got = memoryview(payload), 0
    while got < n_payload:
        chunk = await reader.read(min(n_payload - got, BIG_PAYLOAD))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:got]), n_payload)
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return body, cast(bytes, payload)  # a bytearray: read as bytes by every unpacker (no copy)


_DEADLINE = object()  # queued by a call's deadline timer

# A stream handler takes a call's body and payload and yields (reply body, payload) pairs; the last ends the stream.
StreamHandler = Callable[[CallBody, bytes], AsyncIterator[tuple[ReplyBody, bytes]]]


HELLO_TIMEOUT_S = 5.0


class StreamSink:
    """A handler's direct line to its call's stream: send() writes a reply frame at once, from a callback on the
    event loop, instead of the handler yielding it (a task wake-up and generator resumptions per frame). The
    frames keep their order with the ones yielded, and the end frame follows them all."""

    __slots__ = ("sid", "out", "ended")

    def __init__(self, sid: int, out: "_Coalescer") -> None:
        self.sid, self.out = sid, out
        self.ended = False

    def send(self, body: ReplyBody, data: bytes = b"") -> None:
        if data:
            self.out.write(*frame_parts(Reply(self.sid, body), data))
        else:
            self.out.reply(Reply(self.sid, body))

    def end(self, error: str | None = None, code: int = 0) -> None:
        """The stream's last frame (with the error that ended it, if one did); once. A handler may end its stream
        with its last output, in the same write, before it returns: the caller's stream is then over at once,
        and it has nothing to cancel if it stops reading there."""
        if self.ended:
            if error is not None:
                log.warning("stream %d already ended; its later error is dropped: %s", self.sid, error)
            return
        self.ended = True
        self.out.reply(Reply(self.sid, end=True, error=error, code=code))


_SINK: contextvars.ContextVar[StreamSink | None] = contextvars.ContextVar("hpc_rpc_sink", default=None)


def current_sink() -> StreamSink | None:
    """The stream of the call whose handler is running (in the RPC server's task for that call), else None."""
    return _SINK.get()


class _Coalescer:
    """The replies one connection gets during one pass of the event loop leave in one write, those without a
    payload in one frame of replies (wire.REPLIES_FRAME): a decode step wakes every stream at once, so its 64
    tokens cost one encode and one send() instead of 64 of each (and the GIL the engine thread needs is held that much
    less). Latency: at most the rest of the current loop pass. Order on the connection is kept."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: list[bytes | memoryview] = []
        self.replies: list[Reply] = []  # after `pending`, in one frame

    def reply(self, reply: Reply) -> None:
        self._flush_soon()
        self.replies.append(reply)

    def write(self, *parts: bytes | memoryview) -> None:
        self._flush_soon()
        self._close_replies()
        self.pending.extend(parts)

    def _flush_soon(self) -> None:
        """The first frame of this loop pass: the flush that sends them all runs at the pass's end."""
        if not self.pending and not self.replies:
            asyncio.get_running_loop().call_soon(self.flush)

    def _close_replies(self) -> None:
        if self.replies:
            self.pending.append(encode_replies(self.replies))
            self.replies = []

    def flush(self) -> None:
        self._close_replies()
        frames, self.pending = self.pending, []
        if not frames or self.writer.is_closing():  # the caller went away: nobody to answer
            return
        if any(len(part) >= BIG_PAYLOAD for part in frames):
            self.writer.writelines(frames)  # uvloop sends the pieces as they are: a large payload is not copied
        else:
            self.writer.write(b"".join(frames))


def _no_calls(change: int) -> None:
    pass


class RpcServer:
    """Serves streamed calls, dispatched on the type of the call's body; with a token, a connection must open with
    a `Hello` carrying it or it is closed before anything runs (the job's workers listen on their node's address)."""

    def __init__(self, handlers: dict[type, StreamHandler], token: str | None = None,
                 on_activity: Callable[[int], None] = _no_calls) -> None:
        self.handlers = handlers
        self.token = token
        self.on_activity = on_activity  # a call's start (+1) and end (-1): IdleSpin.calls
        self.refused = 0
        self.server: asyncio.base_events.Server | None = None
        self.inflight = 0
        self.cancels = 0  # Cancel frames read: a caller that stopped reading a stream before its end
        self._tasks: set[asyncio.Task] = set()
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}  # each open connection's task, writer

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port, reuse_address=True)

    @property
    def port(self) -> int:
        if self.server is None:
            raise RuntimeError("the RPC server is not listening yet")
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        # Connections end by their reads seeing the close, not by asyncio.run cancelling their tasks at exit
        # (which Python 3.11's stream callback logs as an error with a traceback).
        connections = dict(self._connections)
        for writer in connections.values():
            writer.close()
        if connections:
            await asyncio.wait(connections, timeout=1)

    async def _hello(self, reader: asyncio.StreamReader) -> bool:
        try:
            body, _ = await asyncio.wait_for(_read_raw(reader), HELLO_TIMEOUT_S)
            hello = decode_call(body).body
        except (asyncio.TimeoutError, DecodeError):
            return False
        return isinstance(hello, Hello) and hmac.compare_digest(hello.token.encode(), (self.token or "").encode())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        streams: dict[int, asyncio.Task] = {}
        out = _Coalescer(writer)
        this = asyncio.current_task()
        if this is None:
            raise RuntimeError("an RPC connection is served outside a task")
        self._connections[this] = writer
        try:
            if self.token is not None and not await self._hello(reader):
                self.refused += 1
                log.warning("refused an RPC connection without the job's token")
                return
            while True:
                raw, payload = await _read_raw(reader)
                if payload is None:
                    log.warning("closing an RPC connection that sent replies, not calls")
                    return
                try:
                    call = decode_call(raw)
                except DecodeError as exc:  # a malformed body: answer on its stream when its id is readable
                    sid = call_id(raw)
                    if sid is None:
                        log.warning("closing an RPC connection that sent an unreadable frame: %s", exc)
                        return
                    writer.write(encode_frame(Reply(sid, end=True, error=f"bad request: {exc}", code=400)))
                    continue
                if isinstance(call.body, Cancel):
                    self.cancels += 1
                    task = streams.pop(call.id, None)
                    if task:
                        task.cancel()
                    continue
                task = asyncio.create_task(self._run(call, payload, out, streams))
                streams[call.id] = task
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for task in streams.values():  # the client went away: cancel its engine requests
                task.cancel()
            writer.close()
            del self._connections[this]

    async def _run(self, call: Call, payload: bytes, out: "_Coalescer",
                   streams: dict[int, asyncio.Task]) -> None:
        sid = call.id
        writer = out.writer
        handler = self.handlers.get(type(call.body))
        self.inflight += 1
        self.on_activity(1)
        sink = StreamSink(sid, out)
        _SINK.set(sink)  # this task's context: the handler may write frames from callbacks
        try:
            if handler is None:
                raise RemoteError(f"this worker does not serve {type(call.body).__name__}", 400)
            async for body, data in handler(call.body, payload):
                sink.send(body, data)
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    out.flush()
                    await writer.drain()
            sink.end()
        except asyncio.CancelledError:
            pass
        except RemoteError as exc:
            if exc.code >= 500:  # this worker's failure, named by the request's id (its client's x-request-id)
                log.warning("%s failed: %d %s", _named(call.body), exc.code, exc)
            sink.end(str(exc), exc.code)
        except ValueError as exc:  # bad request content
            sink.end(str(exc), 400)
        except Exception as exc:
            log.exception("%s failed: 500", _named(call.body))
            sink.end(f"{type(exc).__name__}: {exc}", 500)
        finally:
            self.inflight -= 1
            self.on_activity(-1)
            streams.pop(sid, None)


def _ended(queue: asyncio.Queue) -> bool:
    """Has the stream's end (or an error, or the connection's loss) arrived already, unread? Then a caller that
    stopped reading has nothing to cancel (a handler ends its stream with its last output, in the same frame)."""
    while not queue.empty():
        item = queue.get_nowait()
        if item is None or (item is not _DEADLINE and (item[0].end or item[0].error)):
            return True  # (a passed deadline is no end: the worker still runs the request)
    return False


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
            self._writer.write(encode_frame(Call(0, Hello(token=self.token))))
        self._reader_task = asyncio.create_task(self._read(reader))

    @property
    def connected(self) -> bool:
        return self._writer is not None and self.alive

    async def open(self) -> None:
        """Connect now, not on the first call (a worker learnt from discovery, before traffic needs it)."""
        await self._ensure()

    async def _ensure(self) -> asyncio.StreamWriter:
        if self._writer is None:
            async with self._lock:
                if self._writer is None:
                    await self.connect()
        if not self.alive or self._writer is None:
            raise PeerGone(f"{self.host}:{self.port} is gone")
        return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                raw, payload = await _read_raw(reader)
                for reply in decode_replies(raw) if payload is None else (decode_reply(raw),):
                    queue = self._queues.get(reply.id)
                    if queue is not None:
                        queue.put_nowait((reply, payload or b""))
        except (asyncio.IncompleteReadError, ConnectionError, OSError, DecodeError):
            pass
        finally:
            self.alive = False
            for queue in self._queues.values():
                queue.put_nowait(None)
            if self.on_lost:
                self.on_lost(self)

    async def stream(self, body: CallBody, payload: bytes = b"",
                     deadline: float | None = None) -> AsyncGenerator[tuple[ReplyBody, bytes], None]:
        """Reply bodies of one call; past `deadline` (event-loop time) asyncio.TimeoutError, and the server is told
        to cancel. The deadline is a timer that drops a marker in the queue: nothing is paid per frame."""
        writer = await self._ensure()
        sid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[sid] = queue
        finished = False
        timer = asyncio.get_running_loop().call_at(deadline, queue.put_nowait, _DEADLINE) if deadline else None
        what = type(body).__name__
        try:
            if writer.is_closing():  # dropped, and the reader has not noticed yet
                raise PeerGone(f"connection to {self.host}:{self.port} lost")
            writer.writelines(frame_parts(Call(sid, body), payload))
            while True:
                item = await queue.get()
                if item is None:
                    raise PeerGone(f"connection to {self.host}:{self.port} lost")
                if item is _DEADLINE:
                    raise asyncio.TimeoutError(f"{what} on {self.host}:{self.port} passed its deadline")
                reply, data = item
                if reply.error:
                    finished = True
                    raise RemoteError(reply.error, reply.code or 500)
                if reply.end:
                    finished = True
                    return
                yield reply.body, data
                if isinstance(reply.body, GenerateOutput) and reply.body.finished:
                    # a request's last output: its end frame follows (in the same frame from our workers) and is
                    # not waited for, so a caller reading on is done at once, and one that stops has nothing to
                    # close or cancel
                    finished = True
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self._queues.pop(sid, None)
            if not finished and not _ended(queue) and self.alive and self._writer is not None \
                    and not self._writer.is_closing():
                self._writer.write(encode_frame(Call(sid, Cancel())))  # caller stopped early

    async def call(self, body: CallBody, payload: bytes = b"") -> tuple[ReplyBody | None, bytes]:
        """The last reply of a call that answers once (or its last frame)."""
        result: tuple[ReplyBody | None, bytes] = (None, b"")
        async for item in self.stream(body, payload):
            result = item
        return result

    async def close(self) -> None:
        self.alive = False
        if self._writer is not None:
            self._writer.close()
        if self._reader_task:
            self._reader_task.cancel()


class OpenAhead:
    """Connections opened before the first request needs them (from discovery's callback, on the event loop):
    that request then pays for neither the connection nor the token's Hello. A failure is only logged; the
    first call connects again."""

    def __init__(self, peer_kind: str) -> None:
        self.peer_kind = peer_kind
        self._opening: set[asyncio.Task] = set()  # held until done, so they are not collected

    def open(self, client: RpcClient) -> None:
        if client.connected:
            return
        task = asyncio.get_running_loop().create_task(client.open())
        self._opening.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._opening.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("connecting ahead to a %s failed: %s", self.peer_kind, task.exception())
