"""The link between a worker and its engine in a process of its own (engine_process.py, engine_core.py).

Two socket pairs, each one way: requests, cancellations, stats questions and a prefill worker's KV fetches and
releases go worker -> engine; a decode step's outputs (all of its rows in one message), refusals, KV answers,
stats, KV events and a decode engine's completed KV copies come back. A message is a 4-byte length
and a msgpack body, typed by msgspec as the RPC's frames are (wire.py), so neither side sees an untyped dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Union

import msgspec
from msgspec import Struct

from hpc.runtime.engine.torch.kv_records import KvRecord
from hpc.runtime.engine.types import GenerateOutput, GenerateRequest, KvMeta
from hpc.runtime.serve.wire import FetchKv

LENGTH = struct.Struct(">I")


class _Link(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    pass


# ---- worker -> engine ---------------------------------------------------------------------------------------
class Submit(_Link, frozen=True, tag="submit"):
    key: int
    request: GenerateRequest
    sent: float = 0.0  # the worker's time.perf_counter() as it sent this (CLOCK_MONOTONIC: one clock per host)


class Drop(_Link, frozen=True, tag="drop"):
    """The worker no longer wants `key`'s outputs (its caller went away): the scheduler frees the slot."""

    key: int


class AskStats(_Link, frozen=True, tag="ask_stats"):
    pass


class AskKv(_Link, frozen=True, tag="ask_kv"):
    """A decode worker's FetchKv, passed on by a prefill worker to its engine process (which holds the KV)."""

    ask: int
    call: FetchKv


class ReleaseHeld(_Link, frozen=True, tag="release_held"):
    """A decode worker's ReleaseKv, passed on: the KV lent under `handle` may be freed."""

    handle: str


class Stop(_Link, frozen=True, tag="stop"):
    pass


# ---- engine -> worker ---------------------------------------------------------------------------------------
class Ready(_Link, frozen=True, tag="ready"):
    pid: int


class Outputs(_Link, frozen=True, tag="outputs"):
    """One decode step's outputs (or one output outside a step), in the order the engine sent them; its rows'
    bare tokens (Emitter.send_tokens) apart: a key a row and `token_steps` tokens a row in turn (a replay of
    several steps), of which the worker makes one output, with what an earlier output of the request carried."""

    keys: list[int]
    outputs: list[GenerateOutput]
    token_keys: list[int] = []
    tokens: list[int] = []
    token_steps: int = 1
    sent: float = 0.0  # the engine process's time.perf_counter() as it sent this (Submit's clock)


class Refused(_Link, frozen=True, tag="refused"):
    """`key` never reached the scheduler: 400 for the request's fault (ValueError), else the engine's."""

    key: int
    message: str
    code: int


class KvAnswer(_Link, frozen=True, tag="kv_answer"):
    """The answer to AskKv `ask`: where the KV lies (CUDA IPC, NIXL) or its bytes; or why not (`code`)."""

    ask: int
    meta: KvMeta | None = None
    data: bytes = b""
    error: str = ""
    code: int = 0


class Stats(_Link, frozen=True, tag="stats"):
    values: dict[str, float]


class KvEvents(_Link, frozen=True, tag="kv_events"):
    """A prefill step's prefix-cache records (stored / removed blocks), in order: one message a step, not one a
    record (with a full pool, three a prompt); the worker publishes each in TensorRT-LLM's form."""
    records: list[KvRecord]


class Failed(_Link, frozen=True, tag="failed"):
    error: str


class ReleaseKvs(_Link, frozen=True, tag="release_kvs"):
    """The engine's copies of these prefills' KVs (CUDA IPC) completed: its worker tells each prefill worker
    (ReleaseKv), so that the engine process's event loop, and the GIL it would take from the scheduler thread,
    is not woken for them. `addresses[i]` is the RPC address of the prefill worker holding `handles[i]`."""

    addresses: list[str]
    handles: list[str]


ToEngine = Union[Submit, Drop, AskStats, AskKv, ReleaseHeld, Stop]
FromEngine = Union[Ready, Outputs, Refused, KvAnswer, Stats, KvEvents, Failed, ReleaseKvs]
_encoder = msgspec.msgpack.Encoder()


def encode(message: _Link) -> bytes:
    body = _encoder.encode(message)
    return LENGTH.pack(len(body)) + body


class Frames:
    """Length-prefixed messages out of a byte stream, however its bytes arrive."""

    def __init__(self, kind: Any) -> None:
        self.decoder = msgspec.msgpack.Decoder(kind)
        self.buffer = bytearray()

    def feed(self, data: bytes | memoryview) -> list[Any]:
        self.buffer += data
        messages, pos, view = [], 0, memoryview(self.buffer)
        try:
            while len(view) - pos >= LENGTH.size:
                (n,) = LENGTH.unpack_from(view, pos)
                if len(view) - pos - LENGTH.size < n:
                    break
                messages.append(self.decoder.decode(view[pos + LENGTH.size:pos + LENGTH.size + n]))
                pos += LENGTH.size + n
        finally:
            view.release()  # the buffer cannot shrink while a view of it lives
        del self.buffer[:pos]
        return messages


class Receiver(asyncio.Protocol):
    """Reads length-prefixed messages on an event loop and hands each, decoded, to `on_message`; `on_closed` when
    the other end is gone (its process exited or closed the link)."""

    def __init__(self, kind: Any, on_message: Callable[[Any], None], on_closed: Callable[[], None]) -> None:
        self.frames = Frames(kind)
        self.on_message, self.on_closed = on_message, on_closed
        self.transport: asyncio.Transport | None = None

    @property
    def buffer(self) -> bytearray:
        return self.frames.buffer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for message in self.frames.feed(data):
            self.on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_closed()


class Poller:
    """Reads length-prefixed messages from a socket without an event loop: an engine process's scheduler thread
    polls its requests between steps (engine_core.Core.intake)."""

    def __init__(self, sock: socket.socket, kind: Any, spin_s: float = 0.0) -> None:
        sock.setblocking(False)
        self.sock, self.frames = sock, Frames(kind)
        self.closed = False
        # an idle scheduler first polls without sleeping for spin_s after it last had work (runtime.idle_spin_us)
        self.spin_s = spin_s
        self.busy_at = 0.0  # the last look that found messages or did not wait (the scheduler had work)
        self.spin_seconds = 0.0
        self.spin_finds = 0  # spins that ended with a message or a wake-up: a wait with no sleep to wake from
        # read into, not a fresh 1 MB bytes object for every look at the socket: the scheduler looks once a step,
        # mostly to find nothing (2.4-3.0 µs a look against 1.3-1.6, a 2-CPU VM)
        self._chunk = memoryview(bytearray(1 << 20))
        self._woken, self._wake = socket.socketpair()  # wake() ends a wait from another thread
        self._woken.setblocking(False)
        self._wake.setblocking(False)

    def _spin(self, watched: list[socket.socket]) -> list[socket.socket]:
        """Poll `watched` without sleeping until spin_s after the scheduler last had work; what became ready."""
        start = time.perf_counter()
        until = self.busy_at + self.spin_s
        ready: list[socket.socket] = []
        now = start
        while now < until:
            ready = select.select(watched, [], [], 0)[0]
            now = time.perf_counter()
            if ready:
                self.spin_finds += 1
                break
        self.spin_seconds += now - start
        return ready

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is already on its way
            self._wake.send(b"\0")

    def poll(self, wait: float) -> list[Any]:
        """The messages that arrived, waiting up to `wait` seconds for the first or a wake(); `closed` once the
        other end is gone."""
        if wait > 0:
            watched = [self._woken] if self.closed else [self.sock, self._woken]
            ready = self._spin(watched) if self.spin_s else []
            if not ready:
                ready = select.select(watched, [], [], wait)[0]
            if self._woken in ready:
                with contextlib.suppress(BlockingIOError):
                    while self._woken.recv(4096):
                        pass
            if self.sock not in ready:
                return []
        else:
            self.busy_at = time.perf_counter()
        if self.closed:
            return []
        messages = []
        while True:
            try:
                n = self.sock.recv_into(self._chunk)
            except (BlockingIOError, InterruptedError):
                if messages:
                    self.busy_at = time.perf_counter()
                return messages
            except OSError:
                n = 0
            if not n:
                self.closed = True
                return messages
            messages += self.frames.feed(self._chunk[:n])


async def receive(sock: socket.socket, kind: Any, on_message: Callable[[Any], None],
                  on_closed: Callable[[], None]) -> asyncio.Transport:
    """Start reading `sock` on the running loop; returns the transport (its write() sends the other way, on a
    socket used both ways)."""
    transport, _ = await asyncio.get_running_loop().create_unix_connection(
        lambda: Receiver(kind, on_message, on_closed), sock=sock)
    return transport


class BlockingSender:
    """Sends from any thread (the engine's scheduler thread writes a step's outputs itself, the event loop its
    answers): one lock, blocking writes. A full socket holds the writer back until the worker reads."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock, self.lock = sock, threading.Lock()

    def send(self, message: _Link) -> None:
        data = encode(message)
        with self.lock:
            self.sock.sendall(data)
