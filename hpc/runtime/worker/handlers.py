"""Request handlers, one per disaggregation mode, chosen from an enum-keyed registry."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, cast

from hpc.runtime.engine.types import DisaggregationMode, EncodedMedia, Engine, GenerateRequest
from hpc.runtime.worker.media import MediaError, read_image_bytes, to_pixels
from hpc.runtime.serve.rpc import OpenAhead, RemoteError, RpcClient, StreamHandler, current_sink
from hpc.runtime.worker.engine_process import engine_stats
from hpc.runtime.serve.wire import (
    EncodeImage, FetchKv, ReleaseKv, ReplyBody, StatsQuery, VideoProgress, VideoRequest, WorkerStats, replace,
)

Frame = tuple[ReplyBody, bytes]


PEER_FIRST_WAIT_S = 10.0  # how long a request waits for discovery to list a role this worker never saw yet


class Peers:
    """RPC clients to other workers (prefill for KV, encode for embeddings), one connection each."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.clients: dict[str, RpcClient] = {}
        self.instances: dict[str, Any] = {}  # discovery snapshot, kept fresh by the worker (update)
        self.seen: set[str] = set()  # roles any snapshot listed
        self.first_listed: float | None = None  # when discovery's first list came (monotonic)
        self._changed = asyncio.Event()
        self._ahead = OpenAhead("peer worker")

    def update(self, snapshot: dict[str, Any]) -> None:
        self.instances = snapshot
        self.seen.update(i.role for i in snapshot.values())
        self.first_listed = self.first_listed or time.monotonic()
        self._changed.set()

    def client(self, address: str) -> RpcClient:
        c = self.clients.get(address)
        if c is None or not c.alive:
            host, _, port = address.rpartition(":")
            c = self.clients[address] = RpcClient(host, int(port), token=self.token)
        return c

    def preconnect(self, roles: tuple[str, ...]) -> None:
        """Connect to the listed instances of `roles` now (from discovery's callback), so that the first request
        that needs one does not pay for the connection."""
        for inst in self.instances.values():
            if inst.role in roles:
                self._ahead.open(self.client(inst.address))

    async def pick(self, role: str, first_wait_s: float = PEER_FIRST_WAIT_S) -> str:
        """A live worker of `role`. One this worker's discovery has not listed yet is waited for, up to
        `first_wait_s` after its first list (workers register in any order: the first image after the job turns
        ready could reach a prefill worker before the encode worker's key does); one that was listed and is gone,
        or never came, is refused at once."""
        deadline = (self.first_listed or time.monotonic()) + first_wait_s
        while True:
            live = sorted(i.address for i in self.instances.values() if i.role == role and not i.draining)
            if live:
                return live[int(time.monotonic() * 1000) % len(live)]
            left = deadline - time.monotonic()
            if role in self.seen or left <= 0:
                raise RemoteError(f"no live {role} worker", 503)
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()


@dataclass
class HandlerDeps:
    """Everything a handler needs, in one typed bundle."""

    engine: Engine
    mode: DisaggregationMode
    peers: Peers
    allowed_local_media_path: str | None
    media_allowed_hosts: list[str]
    max_file_size_mb: float
    image_size: int | None
    has_encode_role: bool
    on_first_token: Callable[[], None] = lambda: None
    kv: Any = None  # the KV handoff (kv_handoff.KvHandoff); prefill workers answer fetches through it
    counters: dict[str, float] = field(default_factory=lambda: {"requests_total": 0, "errors_total": 0,
                                                                "tokens_total": 0})


class HandlerBase:
    def __init__(self, deps: HandlerDeps) -> None:
        self.deps = deps

    def ops(self) -> dict[type, StreamHandler]:
        """The calls this worker answers, keyed by the wire type of the call."""
        ops = {GenerateRequest: self.generate, StatsQuery: self.stats}
        return cast("dict[type, StreamHandler]", ops)  # each takes the call type it is keyed by

    async def stats(self, query: StatsQuery, payload: bytes) -> AsyncGenerator[Frame, None]:
        yield WorkerStats(values={**await engine_stats(self.deps.engine), **self.deps.counters}), b""

    async def _media(self, request: GenerateRequest) -> GenerateRequest:
        """Attach image embeddings: from an encode worker when the recipe has one, else encode here."""
        if not request.image or request.media is not None:
            return request
        if self.deps.has_encode_role:
            address = await self.deps.peers.pick("encode")
            try:
                media, _ = await self.deps.peers.client(address).call(
                    EncodeImage(image=request.image, prompt_token_ids=list(request.token_ids)))
            except ConnectionError as exc:  # (PeerGone too) which peer: the client sees this worker's answer
                raise RemoteError(f"encode worker at {address} failed: {exc}", 502) from None
            if not isinstance(media, EncodedMedia):
                raise RemoteError("the encode worker answered without embeddings", 502)
            return replace(request, media=media)
        if self.deps.engine.traits.own_image_loader:
            return request  # the engine takes the image with the prompt (TensorRT-LLM's input processor)
        pixels = await _load_pixels(self.deps, request.image)
        return replace(request, media=await self.deps.engine.encode(pixels))

    async def generate(self, request: GenerateRequest, payload: bytes) -> AsyncGenerator[Frame, None]:
        request = await self._media(request)
        self.deps.counters["requests_total"] += 1
        sink, direct = current_sink(), self.deps.engine.traits.direct_stream
        with self._counted() as tally:
            if sink is not None and direct:  # each output written as it arrives, nothing yielded
                self.deps.counters["requests_streamed_direct"] = \
                    self.deps.counters.get("requests_streamed_direct", 0) + 1

                def deliver(out) -> None:
                    tally(out)
                    sink.send(self._answer(out))
                    if out.finished:  # the end in the same frame: the caller's stream is over now, not a loop
                        sink.end()  # pass later (a frontend waits for a prefill's end before the decode)

                await self.deps.engine.stream(request, deliver)
                return
            async for out in self.deps.engine.generate(request):
                tally(out)
                yield self._answer(out), b""

    def _answer(self, out):
        """An output as it leaves this worker (a prefill worker adds where its KV can be read)."""
        return out

    @contextlib.contextmanager
    def _counted(self):
        """One request's accounting, either way its outputs leave: tokens and errors counted, first token told."""
        tally = _Tally(self.deps)
        try:
            yield tally
        except Exception:
            self.deps.counters["errors_total"] += 1
            raise
        finally:
            self.deps.counters["tokens_total"] += tally.produced


class _Tally:
    """Looks at each output of one request: an error output raises, the first token is reported, tokens counted."""

    def __init__(self, deps: HandlerDeps) -> None:
        self.deps, self.produced = deps, 0

    def __call__(self, out) -> None:
        if out.error:
            raise RemoteError(out.error, 500)
        if out.token_ids and self.produced == 0:
            self.deps.on_first_token()
        self.produced += len(out.token_ids)


async def _load_pixels(deps: HandlerDeps, image: str):
    """The image in the form the engine encodes: its own loader (TensorRT-LLM), else a pixel tensor."""
    own_loader = deps.engine.traits.own_image_loader
    if deps.image_size is None and not own_loader:
        raise RemoteError("this model takes no images", 400)
    try:
        data = await asyncio.to_thread(read_image_bytes, image, allowed_local_path=deps.allowed_local_media_path,
                                       max_file_size_mb=deps.max_file_size_mb, allowed_hosts=deps.media_allowed_hosts)
        if own_loader:
            return await asyncio.to_thread(deps.engine.load_image, data)
        return await asyncio.to_thread(to_pixels, data, deps.image_size or 0)  # set where no loader (above)
    except (MediaError, ValueError) as exc:
        raise RemoteError(str(exc), 400) from None


class AggregatedHandler(HandlerBase):
    """Prefill and decode in one engine."""


class PrefillHandler(HandlerBase):
    """Runs the prompt, returns the first token and where its KV cache waits (shared over CUDA IPC in the answer
    where it can be, kv_handoff.KvHandoff.shared_now); serves KV fetches."""

    def ops(self):
        return {**super().ops(), FetchKv: self.fetch_kv, ReleaseKv: self.release_kv}

    def _answer(self, out):
        return out if self.deps.kv is None else self.deps.kv.attach_shared(out)

    async def fetch_kv(self, call: FetchKv, payload: bytes) -> AsyncGenerator[Frame, None]:
        yield await self.deps.kv.answer(call)


    async def release_kv(self, call: ReleaseKv, payload: bytes) -> AsyncGenerator[Frame, None]:
        self.deps.kv.release(call.handle)
        return
        yield  # an async generator that answers nothing


class DecodeHandler(HandlerBase):
    """Continues from a prefill worker's params; the engine pulls the KV cache from that worker."""

    async def generate(self, request: GenerateRequest, payload: bytes) -> AsyncGenerator[Frame, None]:
        if request.disaggregated_params is None:
            raise RemoteError("a decode worker needs disaggregated_params from a prefill worker", 400)
        async for frame in super().generate(request, payload):
            yield frame


class EncodeHandler(HandlerBase):
    """Image -> embeddings."""

    def ops(self):
        return {EncodeImage: self.encode, StatsQuery: self.stats}

    async def encode(self, call: EncodeImage, payload: bytes) -> AsyncGenerator[Frame, None]:
        self.deps.counters["requests_total"] += 1
        pixels = await _load_pixels(self.deps, call.image)
        yield await self.deps.engine.encode(pixels, call.prompt_token_ids), b""


class VideoHandler(HandlerBase):
    """Prompt tokens -> an MP4 in the output directory: progress after every step, then the result. A caller that
    goes away cancels the video at the next step (on every rank)."""

    def ops(self):
        return {VideoRequest: self.video, StatsQuery: self.stats}

    async def video(self, call: VideoRequest, payload: bytes) -> AsyncGenerator[Frame, None]:
        loop = asyncio.get_running_loop()
        progress: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        self.deps.counters["requests_total"] += 1

        def on_step(done: int, total: int) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(progress.put_nowait, VideoProgress(step=done, steps=total))

        task = asyncio.ensure_future(self.deps.engine.generate_video(call, on_step, cancel))
        task.add_done_callback(lambda _: progress.put_nowait(None))
        try:
            while (item := await progress.get()) is not None:
                yield item, b""
            try:
                result = task.result()
            except ValueError as exc:
                raise RemoteError(str(exc), 400) from None
            except Exception:
                self.deps.counters["errors_total"] += 1
                raise
            yield result, b""
        finally:
            if not task.done():
                cancel.set()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task


HANDLERS: dict[DisaggregationMode, type[HandlerBase]] = {
    DisaggregationMode.AGGREGATED: AggregatedHandler,
    DisaggregationMode.PREFILL: PrefillHandler,
    DisaggregationMode.DECODE: DecodeHandler,
    DisaggregationMode.ENCODE: EncodeHandler,
}


def make_handler(deps: HandlerDeps) -> HandlerBase:
    if deps.engine.traits.video:  # a video-diffusion worker (modality video_diffusion)
        return VideoHandler(deps)
    return HANDLERS[deps.mode](deps)
