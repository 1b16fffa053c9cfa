"""A worker's torch engine in a process of its own, used as the worker uses an engine in its own process.

Why: a decode worker at 64 streams kept one core busy and its GIL held 71 % of the time, shared by the engine's
scheduler thread (staging each step, reading its tokens, admitting requests) and the event loop's output path
(each token's frame to the frontend): each waited for the other (docs/performance-log.md). Apart, each has a GIL of
its own; what crosses between them is one message per decode step (every row's output) and one per request.
vLLM V1 splits its EngineCore from the API server process the same way.

`runtime.engine_process` chooses (engine_in_own_process): own, worker, or auto — own for aggregated, prefill and
decode workers of one rank on a GPU. A prefill worker's engine process holds the KV it hands over: it shares it
with the answers (CUDA IPC) itself, and the worker passes decode workers' fetches and releases on to it
(EngineHandoff). A worker of several ranks keeps its engine (rank 0's engine is an MPI rank), and so does an
encode worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
import sys
import time
from typing import Any, AsyncGenerator, Callable

from hpc.runtime.engine.torch.kv_records import publish_each
from hpc.runtime.engine.torch.outputs import rows_tokens
from hpc.runtime.engine.types import (DisaggregationMode, Engine, EngineBase, EngineTraits, GenerateOutput,
                                      GenerateRequest, KvMeta)
from hpc.runtime.serve.rpc import RemoteError
from hpc.runtime.serve.wire import FetchKv
from hpc.runtime.worker.engine_link import (
    AskKv, AskStats, Drop, Failed, FromEngine, KvAnswer, KvEvents, Outputs, Ready, Refused, ReleaseHeld, ReleaseKvs,
    Stats, Stop, Submit, encode, receive,
)
from hpc.runtime.worker.kv_handoff import Releases, release_all
from hpc.spec.recipe import Backend

log = logging.getLogger("hpc.worker")
STATS_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 15.0
CLOSED_GRACE_S = 1.0
EXIT_GRACE_S = 0.25  # an exit before ready: for the Failed message already in the link to be read (< CLOSED_GRACE_S)


class _Stream:
    """A request the engine process holds: where its outputs go, and what its bare tokens' outputs repeat."""

    __slots__ = ("deliver", "done", "prompt_tokens", "cached")

    def __init__(self, deliver: Callable[[GenerateOutput], None], done: asyncio.Future, prompt_tokens: int) -> None:
        self.deliver, self.done, self.prompt_tokens, self.cached = deliver, done, prompt_tokens, 0


def engine_in_own_process(setting: str, backend: Backend, modality: str, mode: DisaggregationMode, ranks: int,
                          on_gpu: bool) -> bool:
    if setting == "worker" or backend is not Backend.TORCH or modality != "text" or ranks > 1:
        return False
    if mode is DisaggregationMode.ENCODE:
        return False
    return setting == "own" or on_gpu


async def engine_stats(engine: Engine) -> dict[str, float]:
    """The engine's figures now (an engine process is asked; one in this process just answers)."""
    return await engine.fresh_stats()


class EngineProcess(EngineBase):
    """Opened with `async with` (the engine process is loaded and warm when it returns); stream(), generate(),
    stats() and failure as TorchEngine has them."""

    traits = EngineTraits(direct_stream=True, kv_events=True)

    def __init__(self, manifest_file: str, role: str, index: int, device: str, ready_timeout_s: float) -> None:
        self.mode = DisaggregationMode(role)
        self.device = device
        self.failure: str | None = None
        self.on_kv_event: Callable[[dict[str, Any]], None] | None = None
        self.on_release_kvs: Callable[[ReleaseKvs], None] = lambda message: None  # EngineHandoff's
        self.pid: int | None = None
        self._cmd = [sys.executable, "-m", "hpc.runtime.worker.engine_core", manifest_file, "--role", role,
                     "--index", str(index), "--device", device]
        self._ready_timeout_s = ready_timeout_s
        self._keys = itertools.count()
        self._streams: dict[int, _Stream] = {}
        self._stats: dict[str, float] = {}
        self.timing = {"outputs_link_seconds_total": 0.0, "outputs_messages_total": 0}  # this process's own
        self._stats_waiters: list[asyncio.Future] = []
        self._kv_asks: dict[int, asyncio.Future] = {}
        self._ready: asyncio.Future | None = None
        self._proc: subprocess.Popen | None = None
        self._requests: asyncio.Transport | None = None
        self._outputs: asyncio.Transport | None = None
        self._exited: asyncio.Task | None = None
        self._handlers: dict[type, Callable[[Any], None]] = {  # what the engine process says, by message type
            Outputs: self._delivered, Stats: self._stats_arrived, Refused: self._refused, KvAnswer: self._kv_answered,
            KvEvents: self._kv_events, Ready: self._is_ready, Failed: self._failed,
            ReleaseKvs: lambda message: self.on_release_kvs(message)}

    @property
    def returncode(self) -> int | None:
        """The engine process's exit code once it has exited (None while it runs or before it started)."""
        return None if self._proc is None else self._proc.poll()

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> "EngineProcess":
        loop = asyncio.get_running_loop()
        requests, requests_there = socket.socketpair()
        outputs, outputs_there = socket.socketpair()
        fds = (requests_there.fileno(), outputs_there.fileno())
        self._proc = subprocess.Popen([*self._cmd, "--requests-fd", str(fds[0]), "--outputs-fd", str(fds[1])],
                                      pass_fds=fds)
        requests_there.close()
        outputs_there.close()
        self._ready = loop.create_future()
        self._outputs = await receive(outputs, FromEngine, self._on_message, self._on_closed)
        self._requests, _ = await loop.create_unix_connection(asyncio.Protocol, sock=requests)
        # a thread of the default executor waits for the exit all along: the earliest news of a crash
        self._exited = asyncio.create_task(asyncio.to_thread(self._proc.wait))
        self._exited.add_done_callback(self._on_exit)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self._ready_timeout_s)
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stop()

    async def _stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._send(Stop())
        try:
            if self._exited is not None:  # start() made it with the process
                await asyncio.wait_for(asyncio.shield(self._exited), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("the engine process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
            self._proc.kill()
            await self._exited
        for transport in (self._requests, self._outputs):
            if transport is not None:
                transport.close()

    def _on_exit(self, task: asyncio.Task) -> None:
        code = task.result() if not task.cancelled() and task.exception() is None else None
        error = f"the engine process exited (code {code})"
        if self._ready is not None and not self._ready.done() and code:
            # its Failed message, sent before it exited, says more than the code: read it first if it is on its way
            asyncio.get_running_loop().call_later(EXIT_GRACE_S, self._fail, error)
            return
        self._fail(error)

    def _failed(self, message: Failed) -> None:
        self._fail(message.error if self._ready is None or self._ready.done()
                   else f"the engine process failed: {message.error}")

    def _on_closed(self) -> None:
        # the process is exiting, most likely: its exit code (_on_exit) says more than this, if it comes soon
        asyncio.get_running_loop().call_later(CLOSED_GRACE_S, self._fail, "the engine process closed its link")

    def _fail(self, error: str) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"before it was ready, {error}; its log says more"))
        if self.failure is None:
            self.failure = error
        streams, self._streams = self._streams, {}
        waiting = [stream.done for stream in streams.values()] + list(self._kv_asks.values())
        self._kv_asks = {}
        for done in waiting:
            if not done.done():
                done.set_exception(RuntimeError(f"engine failed: {self.failure}"))

    # ---- from the engine ------------------------------------------------------------------------------------
    def _on_message(self, message: Any) -> None:
        self._handlers[type(message)](message)

    def _delivered(self, message: Outputs) -> None:
        if message.sent:  # the engine process's send to this read: a step's outputs on their way back
            self.timing["outputs_link_seconds_total"] += time.perf_counter() - message.sent
            self.timing["outputs_messages_total"] += 1
        streams = self._streams
        for key, out in zip(message.keys, message.outputs):
            stream = streams.get(key)
            if stream is None:  # dropped: the scheduler's last outputs have nowhere to go
                continue
            stream.cached = out.cached_tokens
            if self._deliver(key, stream, out) and out.finished:
                del streams[key]
                stream.done.set_result(None)
        # bare tokens, never a request's first or last: a row's (a replay's steps) one output
        for key, tokens in rows_tokens(message.token_keys, message.tokens, message.token_steps):
            stream = streams.get(key)
            if stream is not None:
                self._deliver(key, stream, GenerateOutput(token_ids=tokens, prompt_tokens=stream.prompt_tokens,
                                                          cached_tokens=stream.cached))

    def _deliver(self, key: int, stream: "_Stream", out: GenerateOutput) -> bool:
        try:
            stream.deliver(out)
        except Exception as exc:  # noqa: BLE001 - the caller's error, raised from stream()
            del self._streams[key]
            self._send(Drop(key=key))
            stream.done.set_exception(exc)
            return False
        return True

    def _stats_arrived(self, message: Stats) -> None:
        self._stats = message.values
        waiters, self._stats_waiters = self._stats_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _refused(self, message: Refused) -> None:
        stream = self._streams.pop(message.key, None)
        if stream is not None:
            stream.done.set_exception(ValueError(message.message) if message.code == 400
                                   else RemoteError(message.message, message.code))

    def _kv_answered(self, message: KvAnswer) -> None:
        asked = self._kv_asks.pop(message.ask, None)
        if asked is None or asked.done():
            return
        if message.error:
            asked.set_exception(RemoteError(message.error, message.code))
        else:
            asked.set_result((message.meta, message.data))

    def _kv_events(self, message: KvEvents) -> None:
        if self.on_kv_event is not None:  # TensorRT-LLM's form made here, off the engine's scheduler thread
            publish_each(self.on_kv_event, message.records)

    def _is_ready(self, message: Ready) -> None:
        self.pid = message.pid
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def _send(self, message: Any) -> None:
        if self._requests is not None and not self._requests.is_closing():
            self._requests.write(encode(message))

    # ---- the engine's interface -----------------------------------------------------------------------------
    async def stream(self, request: GenerateRequest, deliver: Callable[[GenerateOutput], None]) -> None:
        """As TorchEngine.stream: each output to `deliver` on this loop as its step's message arrives; returns
        when the request finished, raises what `deliver` raised or why the engine refused it."""
        if self.failure:
            raise RuntimeError(f"engine failed: {self.failure}")
        key = next(self._keys)
        done = asyncio.get_running_loop().create_future()
        self._streams[key] = _Stream(deliver, done, len(request.token_ids))
        self._send(Submit(key=key, request=request, sent=time.perf_counter()))
        try:
            await done
        finally:
            if self._streams.pop(key, None) is not None:  # the caller went away first
                self._send(Drop(key=key))

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        outputs: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        task = asyncio.create_task(self.stream(request, outputs.put_nowait))
        try:
            while True:
                getter = asyncio.ensure_future(outputs.get())
                await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    task.result()  # raises why it ended without a last output
                    return
                out = getter.result()
                yield out
                if out.finished:
                    return
        finally:
            if not task.done():
                task.cancel()

    async def fetch_kv(self, call: FetchKv) -> tuple[KvMeta, bytes]:
        """A decode worker's fetch of KV this (prefill) engine holds, answered by the engine process."""
        if self.failure:
            raise RuntimeError(f"engine failed: {self.failure}")
        ask = next(self._keys)
        answer = asyncio.get_running_loop().create_future()
        self._kv_asks[ask] = answer
        self._send(AskKv(ask=ask, call=call))
        try:
            return await answer
        finally:
            self._kv_asks.pop(ask, None)

    def release_kv(self, handle: str) -> None:
        self._send(ReleaseHeld(handle=handle))

    def stats(self) -> dict[str, float]:
        """The figures the engine process last sent (every second, and whenever asked), and this side's own."""
        return {**self._stats, **self.timing}

    async def fresh_stats(self) -> dict[str, float]:
        if not self.failure:
            waiter = asyncio.get_running_loop().create_future()
            self._stats_waiters.append(waiter)
            self._send(AskStats())
            try:
                await asyncio.wait_for(waiter, STATS_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        return self.stats()


class EngineHandoff:
    """A worker's KV handoff when its engine runs apart: the engine process fetches (decode), shares with the
    answers (prefill) and counts by itself; a decode worker's fetches and releases of a prefill's KV go on to it."""

    def __init__(self, engine: EngineProcess, peers: Any) -> None:
        self.engine, self.peers = engine, peers
        self.counters: dict[str, float] = {}  # the engine process's counters come with its stats
        self.releases = Releases()
        engine.on_release_kvs = self.release_copied

    def release_copied(self, message: ReleaseKvs) -> None:
        """A decode engine's copies of these KVs completed: each prefill worker may free its own (ReleaseKv, in
        the background)."""
        self.releases.start(release_all([(self.peers.client(address), handle)
                                         for address, handle in zip(message.addresses, message.handles)]))

    def attach_shared(self, out: Any) -> Any:
        return out  # the engine process attached it already, where it could

    async def answer(self, call: FetchKv) -> tuple[KvMeta, bytes]:
        return await self.engine.fetch_kv(call)

    def release(self, handle: str) -> None:
        self.engine.release_kv(handle)

    async def settle(self) -> None:
        await self.releases.settle()

    def close(self) -> None:
        pass
