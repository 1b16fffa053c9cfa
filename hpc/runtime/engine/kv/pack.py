"""KV-cache blocks moved from a prefill worker to a decode worker: tensor <-> bytes (any two machines), or a
CUDA IPC handle (same node, both on GPUs: the decode side copies device to device, no host round trip). No
pickle either way. NIXL, the third way, is in kv_nixl.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hpc.runtime.engine.kv.cuda_ipc import OpenAllocations, export
from hpc.runtime.engine.host_wait import finish
from hpc.runtime.serve.wire import CudaIpc, KvMeta

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def pack(t: torch.Tensor) -> tuple[KvMeta, memoryview]:
    """The KV's bytes without a copy on the host (the view keeps the tensor alive until it is sent)."""
    t = t.detach().contiguous().cpu()
    return KvMeta(shape=list(t.shape), dtype=str(t.dtype)), t.view(torch.uint8).reshape(-1).numpy().data


def dtype_of(meta: KvMeta) -> torch.dtype:
    dtype = _DTYPES.get(meta.dtype)
    if dtype is None:
        raise ValueError(f"KV dtype {meta.dtype!r} is not one of {sorted(_DTYPES)}")
    return dtype


def unpack(meta: KvMeta, data: bytes | bytearray) -> torch.Tensor:
    # A large payload arrives as a bytearray of its own (rpc._read_raw): the tensor may take it over.
    raw = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
    return raw.view(dtype_of(meta)).reshape(meta.shape)


def share(t: torch.Tensor) -> KvMeta:
    """A CUDA tensor (complete: its producer synchronised) as an IPC location; the caller keeps `t` alive until the
    other side released it."""
    t = t.contiguous()
    return KvMeta(shape=list(t.shape), dtype=str(t.dtype), ipc=export(t))


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_COPY_STREAMS_LOCK = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream KV handoffs copy on, one per device: on the engine's own stream a copy would queue behind the
    decode steps already launched, and waiting for it would wait for them (1-4 ms a handoff under load)."""
    if device.index is None:  # one key per GPU: "cuda" and "cuda:0" must find the same stream
        device = torch.device("cuda", torch.cuda.current_device())
    with _COPY_STREAMS_LOCK:
        stream = _COPY_STREAMS.get(device)
        if stream is None:
            stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
        return stream


def handoff_buffer(shape: list[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An empty tensor for a handed-over KV, from the pool of the device's handoff stream on a GPU: the block is
    then not one still read by the engine's launched steps (their stream's freed blocks are reused at once), so a
    writer outside stream order (NIXL) cannot overwrite what a queued kernel reads."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    with torch.cuda.device(device), torch.cuda.stream(copy_stream(device)):
        return torch.empty(shape, dtype=dtype, device=device)


def _ipc(meta: KvMeta) -> CudaIpc:
    if meta.ipc is None:
        raise ValueError("this KV description carries bytes, not a CUDA IPC location")
    return meta.ipc


def copy_shared(metas: list[KvMeta], device: str, opened: OpenAllocations) -> tuple[list[torch.Tensor],
                                                                                   torch.cuda.Event]:
    """Other processes' KVs copied onto `device` (peer to peer across GPUs), the arrivals one admission takes in
    at once: each copy is queued on the device's handoff stream (copy_stream) into a buffer from that stream's
    pool (as handoff_buffer's, under one stream switch for all), and the one event returned completes with them
    all — only then may the owners free their memory. Nothing here waits: a reader on another stream waits for
    the handoff stream (`arrived`, from ContextSteps._import: wait_stream, then record_stream so that the block is
    not reused before it has read).
    Waiting on the host cost a thread hop and GIL hand-offs, 7 ms a handoff on average under load.
    `opened` keeps the owners' allocations open for the next handoffs."""
    ipcs = [_ipc(meta) for meta in metas]
    target = torch.device(device)
    stream = copy_stream(target)
    with torch.cuda.device(target), torch.cuda.stream(stream):
        kvs = [torch.empty(meta.shape, dtype=dtype_of(meta), device=target) for meta in metas]  # handoff buffers
        for ipc, kv in zip(ipcs, kvs):
            opened.copy_into(ipc, kv)
        copied = torch.cuda.Event()
        copied.record(stream)
    return kvs, copied


class PendingCopy:
    """A KV another process shares over CUDA IPC, copied when the engine admits its request: on the scheduler
    thread, which holds the GIL anyway, beside the scatter that reads it. Queued on the event loop's thread as the
    request arrived, the copy's dozen calls that let go of the GIL each waited for it back from the busy
    scheduler (0.21-0.29 ms a copy at c=64 on two H200, the requests behind it waiting their turn on the loop).
    `settled` gets the event the copy completes with (None: never copied) exactly once, from the scheduler's
    thread: the owner may free its memory after that event."""

    def __init__(self, meta: KvMeta, device: str, opened: OpenAllocations,
                 settled: Callable[[torch.cuda.Event | None], None], counters: dict[str, float]) -> None:
        self.meta, self.device, self.opened, self.counters = meta, device, opened, counters
        self._settled: Callable[[torch.cuda.Event | None], None] | None = settled

    def drop(self) -> None:
        """Its request ended before it was admitted: nothing was copied, the owner may free it now."""
        self._settle(None)

    def _settle(self, copied: torch.cuda.Event | None) -> None:
        settled, self._settled = self._settled, None
        if settled is not None:
            settled(copied)


@dataclass(frozen=True)
class InSlot:
    """A handed-over KV already copied into its request's cache slot (take_all with a cache): its token count."""
    length: int


def fits_slot(meta: KvMeta, whole: torch.Tensor) -> bool:
    """May this shared KV [layers, 2, kv_heads, tokens, head_dim] go straight into a slot of the cache `whole`
    [layers, 2, slots, kv_heads, max_len, head_dim]: shared over CUDA IPC, in the cache's dtype, every head of it
    (a decode engine of one rank), and not longer than a slot?"""
    shape = list(getattr(meta, "shape", ()))
    return getattr(meta, "ipc", None) is not None and len(shape) == 5 and meta.dtype == str(whole.dtype) \
        and [shape[0], shape[1], shape[2], shape[4]] == [whole.shape[0], whole.shape[1], whole.shape[3],
                                                         whole.shape[5]] and 0 < shape[3] <= whole.shape[4]


def copy_shared_into(metas: list[KvMeta], whole: torch.Tensor, slots: list[int],
                     opened: OpenAllocations) -> torch.cuda.Event:
    """Other processes' KVs copied straight into their slots of the cache `whole` (each fits_slot), one driver call
    each, on the current stream — the engine's: after the steps already launched, one of which may still write
    the slot for the row that had it, and before the next step, which reads it. The one event returned completes
    with them all: only then may the owners free their memory."""
    for meta, slot in zip(metas, slots):
        opened.copy_into_slot(_ipc(meta), meta.shape, whole, slot)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(whole.device))
    return copied


def take_all(pending: list[PendingCopy], cache: torch.Tensor | None = None,
             slots: list[int] | None = None) -> Sequence[torch.Tensor | InSlot]:
    """The copies of an admission's arrivals (all from one worker's handoff: one device, one set of open
    allocations) queued together: one event for all, on the scheduler's thread, which stops every decoding row
    while it admits (one at a time: 0.16 ms a copy, a burst of 20 arrivals 3 ms at c=64). Into a buffer each
    (copy_shared; the engine then scatters it into the slot), or, given the `cache` and each one's slot (every
    one fits_slot), straight into the slots (InSlot): on two H200 the buffer, the scatter and the streams' waits
    for each were a fifth of a decode engine's scheduler time at c=64."""
    if not pending:
        return []
    first = pending[0]
    if any(p.device != first.device or p.opened is not first.opened for p in pending):
        raise ValueError("KVs copied together come from one handoff")
    if cache is not None and (slots is None or len(slots) != len(pending)):
        raise ValueError("KVs copied into the cache need a slot each")
    began, copied = time.perf_counter(), None
    metas = [p.meta for p in pending]
    try:
        if cache is None or slots is None:  # slots come with a cache (checked above)
            kvs, copied = copy_shared(metas, first.device, first.opened)
        else:
            copied = copy_shared_into(metas, cache, slots, first.opened)
            kvs = [InSlot(meta.shape[3]) for meta in metas]
    finally:
        for p in pending:
            p._settle(copied)
    counters = first.counters
    counters["kv_ipc_opened"] = first.opened.opened
    counters["kv_ipc_open_seconds_total"] = first.opened.open_seconds
    counters["kv_move_seconds_total"] = counters.get("kv_move_seconds_total", 0) + time.perf_counter() - began
    counters["kv_ipc_copy_batches"] = counters.get("kv_ipc_copy_batches", 0) + 1
    if cache is not None:
        counters["kv_ipc_copied_into_slots"] = counters.get("kv_ipc_copied_into_slots", 0) + len(pending)
    return kvs


def arrived(kv: torch.Tensor) -> None:
    """On the stream that reads a handed-over KV (the thread's current one), before reading it: wait for the copies
    queued on the handoff stream (copy_shared's; GPU-side, the host does not wait), and keep the KV's block from
    reuse until this stream is done with it."""
    if kv.is_cuda:
        reader = torch.cuda.current_stream(kv.device)
        reader.wait_stream(copy_stream(kv.device))
        kv.record_stream(reader)


EXPIRY_LOOK_S = 1.0


class HeldKv:
    """A prefill engine's KV caches waiting for their decode workers, by handle: taken as bytes at once, or shared
    (CUDA IPC) / lent (NIXL) until released; dropped after `ttl_s` when no decode worker came for them."""

    def __init__(self, ttl_s: float = 120.0) -> None:
        self.ttl_s = ttl_s
        self._held: dict[str, tuple[float, torch.Tensor, torch.cuda.Event | None]] = {}  # made, KV, ready
        self._lock = threading.Lock()
        self._next_look = 0.0  # when expire looks again

    def put_all(self, kvs: list[tuple[str, torch.Tensor]]) -> None:
        """Each (handle, kv), all on one device, from the scheduler thread right after every copy that made them was
        queued: one event for all (a prefill step's handoffs)."""
        if not kvs:
            return
        ready = None
        if kvs[0][1].is_cuda:  # when those copies are done; a reader in another process cannot see our stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(kvs[0][1].device))
        made = time.monotonic()
        with self._lock:
            for handle, kv in kvs:
                self._held[handle] = (made, kv, ready)

    def take(self, handle: str, ipc: bool = False) -> tuple[KvMeta, bytes | memoryview]:
        """[layers, 2, kv_heads, length, head_dim] as bytes (taken now), or shared over CUDA IPC (`ipc` and the KV is
        on a GPU: kept until release). KeyError for an unknown handle."""
        with self._lock:
            _, kv, ready = self._held[handle]
            shared = ipc and ready is not None
            if not shared:
                del self._held[handle]
        if shared:
            finish(ready)  # another process reads it next: its copy kernel must have finished
            return share(kv), b""
        return pack(kv)

    def ready(self, handle: str) -> torch.cuda.Event | None:
        """The event the KV's copy completes with (None: on the host, complete). KeyError for an unknown handle.
        A caller on an event loop waits for it (polling) before take/lend, which then do not block."""
        with self._lock:
            return self._held[handle][2]

    def lend(self, handle: str) -> torch.Tensor:
        """The KV itself, complete, kept until release: a transport reads it in place."""
        with self._lock:
            _, kv, ready = self._held[handle]
        finish(ready)
        return kv

    def release(self, handle: str) -> None:
        with self._lock:
            self._held.pop(handle, None)

    def expire(self) -> None:
        """Drop what waited past `ttl_s`; looked at once a second at most: the scheduler calls this at every step
        that found no new request (a fiftieth of a decode engine's scheduler time at c=64, with nothing held)."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + EXPIRY_LOOK_S
        with self._lock:
            for handle in [h for h, (made, *_) in self._held.items() if now - made > self.ttl_s]:
                del self._held[handle]

    def __len__(self) -> int:
        return len(self._held)
