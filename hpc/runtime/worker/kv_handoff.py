"""Prefill -> decode KV handoff in the worker: which transport a fetch asks for, the decode side's fetch and the
prefill side's answer. Three ways, chosen per fetch (runtime.kv_transport):

- cuda_ipc: same node, both on GPUs — the decode side copies device to device from the prefill's allocation,
  which it keeps open (cuda_ipc.py; 0.84-0.96 ms the whole fetch of a 262 MB KV on an H100), when its engine
  admits the request (kv.PendingCopy).
- nixl: a NIXL READ from wherever the KV lies (across nodes GPU to GPU; host memory on CPU-only machines).
- bytes: the KV's bytes in the RPC answer — any two machines, the CPU-only default.

The prefill side answers with what it can (no GPU or no NIXL there: bytes); the decode side counts what arrived.
"""

from __future__ import annotations

import asyncio
import math
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Literal

from hpc.runtime.serve.rpc import KV_GONE, KV_TRANSFER_TIMEOUT, RemoteError
from hpc.runtime.serve.wire import FetchKv, KvMeta, KvVia, ReleaseKv, replace

log = logging.getLogger("hpc.worker")
TransportSetting = Literal["auto", "bytes", "nixl"]
EVENT_POLL_S = 0.0002


def choose_via(setting: TransportSetting, on_gpu: bool, same_node: bool, nixl_ready: bool) -> KvVia:
    """The transport a decode worker asks for. CUDA IPC is the fastest on one node (measured, docs/performance.md);
    NIXL is for GPUs on different nodes (bytes would go through both hosts' memory and the RPC socket)."""
    if setting == "bytes":
        return "bytes"
    if setting == "nixl":
        return "nixl"
    if on_gpu and same_node:
        return "cuda_ipc"
    if on_gpu and nixl_ready:
        return "nixl"
    return "bytes"


def wants_nixl(setting: TransportSetting, on_gpu: bool) -> bool | None:
    """Whether this worker needs a NIXL agent: True (required), None (if installed), False (never)."""
    if setting == "nixl":
        return True
    return None if setting == "auto" and on_gpu else False


def open_nixl(setting: TransportSetting, on_gpu: bool, name: str):
    """This worker's NIXL agent, or None where the setting never uses one (or auto and NIXL is not installed)."""
    need = wants_nixl(setting, on_gpu)
    if need is False:
        return None
    from hpc.runtime.engine.kv.nixl import NixlTransport, NixlUnavailable, nixl_available

    if need is None and not nixl_available():
        log.info("NIXL is not installed: KV between nodes moves as bytes over the RPC connection")
        return None
    try:
        return NixlTransport(name)
    except (NixlUnavailable, OSError) as exc:
        raise RuntimeError(f"runtime.kv_transport is nixl but NIXL cannot start here: {exc}") from None


async def completed(event: Any) -> None:
    """Until a CUDA event (or None) has completed, without blocking the event loop's thread: polled, as a host
    wait would hold the thread and give up the GIL, and the copies it waits for take microseconds."""
    while event is not None and not event.query():
        await asyncio.sleep(EVENT_POLL_S)


async def release_all(released: list[tuple[Any, str]], copied: Any = None) -> None:
    """ReleaseKv to each (prefill worker's client, handle) once `copied` (a CUDA event, or None: done) has
    completed: until then the copy reads the prefills' memory."""
    await completed(copied)
    await asyncio.gather(*(prefill.call(ReleaseKv(handle=handle)) for prefill, handle in released))


class Releases:
    """ReleaseKv calls on their way in the background: held so they are not collected, a failure logged (the
    prefill's TTL frees its KV then), waited for before the connections close."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def start(self, release: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(release)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("releasing a handed-off KV failed: %s", task.exception())

    async def settle(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)


@dataclass(frozen=True)
class TransferDeadline:
    """How long a KV transfer may take (runtime.kv_transfer_min_s, kv_transfer_floor_gb_s): a fixed part plus its
    size at a floor bandwidth. Past it the request fails cleanly (504) instead of hanging until a harness times
    out hours later: a transfer wedged on a route or an engine that stopped answering."""

    min_s: float = 10.0
    floor_gb_s: float = 0.5

    def seconds(self, size_bytes: int = 0) -> float:
        return self.min_s + size_bytes / (self.floor_gb_s * 1e9)


def _nbytes(meta: KvMeta) -> int:
    """A KV's size from its layout."""
    size = {"float32": 4, "int32": 4, "float64": 8, "int8": 1, "uint8": 1}.get(meta.dtype.removeprefix("torch."))
    return math.prod(meta.shape) * (size or (1 if "float8" in meta.dtype else 2))


class KvHandoff:
    """Both ends of the handoff for one worker process."""

    def __init__(self, *, setting: TransportSetting, device: str, host: str, engine: Any, peers: Any,
                 counters: dict[str, float], nixl: Any = None, deadline: TransferDeadline = TransferDeadline()) -> None:
        self.setting: TransportSetting = setting
        self.device, self.host, self.deadline = device, host, deadline
        self.timeouts_by_prefill: dict[str, int] = {}  # each prefill worker's transfers that passed their deadline
        self.engine, self.peers, self.counters, self.nixl = engine, peers, counters, nixl
        self.releases = Releases()
        # an engine process's: the released KVs to its worker, (prefill addresses, handles), from any thread
        self.forward_releases: Callable[[list[str], list[str]], None] | None = None
        self._opened = None  # prefill workers' GPU allocations this decode worker has open (CUDA IPC)
        self._settle_lock = threading.Lock()
        self._settling: list[tuple[str, str, Any]] = []  # (address, handle, copy event) settled, not released

    def _count(self, key: str) -> None:
        self._add(key, 1)

    def _add(self, key: str, value: float) -> None:
        self.counters[key] = self.counters.get(key, 0) + value

    # ---- decode: fetch the KV a prefill worker holds ----------------------------------------------------------------
    async def fetch(self, params: Any):
        """The prefill's KV for `params` (DisaggregatedParams), on this worker's device or the host."""
        from hpc.runtime.engine.kv.pack import dtype_of, unpack

        taken = self.fetch_now(params, asyncio.get_running_loop())
        if taken is not None:
            return taken
        address = params.prefill_address
        prefill = self.peers.client(address)
        via = self._via(address)
        known = self.nixl.known_agent(address) if self.nixl is not None else ""
        asked = time.perf_counter()
        expected = _nbytes(params.kv) if params.kv is not None else 0
        try:
            meta, data = await asyncio.wait_for(
                prefill.call(FetchKv(handle=params.request_handle, via=via, nixl_agent=known)),
                self.deadline.seconds(expected))
        except asyncio.TimeoutError:
            raise self._timed_out(prefill, address, params.request_handle, expected, "its answer") from None
        except (ConnectionError, OSError) as exc:  # the prefill worker died holding it: the KV is gone with it
            self._count("kv_prefill_gone_total")
            raise RemoteError(f"the prefill worker {address} holding the KV is gone ({type(exc).__name__}: {exc})",
                              KV_GONE) from None
        answered = time.perf_counter()
        self._add("kv_ask_seconds_total", answered - asked)  # the round trip, bytes included on that path
        if not isinstance(meta, KvMeta):
            raise RemoteError("the prefill worker answered a KV fetch without its layout", 502)
        if meta.ipc is None and meta.nixl is None:
            self._count("kv_fetched_bytes")
            return unpack(meta, data)
        if meta.ipc is not None:
            return self._pending_copy(meta, address, params.request_handle, asyncio.get_running_loop())
        try:
            if self.nixl is None:
                raise RemoteError("the prefill worker lent its KV over NIXL, which this worker lacks", 502)
            try:
                kv = await asyncio.wait_for(asyncio.to_thread(self.nixl.read, address, meta, self.device,
                                                              dtype_of(meta)), self.deadline.seconds(_nbytes(meta)))
            except asyncio.TimeoutError:
                raise self._timed_out(None, address, params.request_handle, _nbytes(meta), "the NIXL read") from None
            self._count("kv_fetched_nixl")
            self._add("kv_move_seconds_total", time.perf_counter() - answered)  # the read
        finally:
            self._start_release(prefill, params.request_handle, None)  # read (or failed): the prefill may free it
        return kv

    def _timed_out(self, prefill: Any, address: str, handle: str, size: int, waited_for: str) -> RemoteError:
        """Counted (in all, and per prefill worker for status), the prefill's KV released, the request failed."""
        self._count("kv_transfer_timeouts_total")
        self.timeouts_by_prefill[address] = self.timeouts_by_prefill.get(address, 0) + 1
        if prefill is not None:  # the NIXL path releases in its own finally
            self._start_release(prefill, handle, None)
        took = self.deadline.seconds(size)
        log.warning("KV transfer from %s passed its deadline: %s took over %.1f s", address, waited_for, took)
        return RemoteError(f"the KV transfer from prefill worker {address} passed its deadline ({waited_for} took "
                           f"over {took:.1f} s: runtime.kv_transfer_min_s {self.deadline.min_s:g} plus "
                           f"{size / 1e6:.0f} MB at kv_transfer_floor_gb_s {self.deadline.floor_gb_s:g})",
                           KV_TRANSFER_TIMEOUT)

    def fetch_now(self, params: Any, loop: asyncio.AbstractEventLoop) -> Any:
        """fetch() where nothing need be asked, from any thread: a KV shared over CUDA IPC with the prefill's
        answer, on this node's GPUs (kv.PendingCopy); None where the KV must be fetched. `loop`: where releases
        go when no forward_releases takes them."""
        if self._via(params.prefill_address) != "cuda_ipc" or params.kv is None or params.kv.ipc is None:
            return None
        self._count("kv_taken_from_answer")
        return self._pending_copy(params.kv, params.prefill_address, params.request_handle, loop)

    def _via(self, address: str) -> KvVia:
        same_node = address.rpartition(":")[0] == self.host
        return choose_via(self.setting, self.device.startswith("cuda"), same_node, self.nixl is not None)

    def _pending_copy(self, meta: KvMeta, address: str, handle: str, loop: asyncio.AbstractEventLoop) -> Any:
        """Copied by the engine as it admits the request (kv.PendingCopy), which then calls back from its thread:
        the prefill may free the KV once that copy has completed. Tried and dropped before (two H200, c=64): the
        copy queued on the event loop's thread (0.21-0.29 ms each, GIL hand-offs with the busy scheduler); a turn's
        arrivals gathered into one call at the loop's next turn (1.05 ms)."""
        from hpc.runtime.engine.kv.pack import PendingCopy

        if self._opened is None:
            from hpc.runtime.engine.kv.cuda_ipc import OpenAllocations

            self._opened = OpenAllocations()
        self._count("kv_fetched_cuda_ipc")
        return PendingCopy(meta, self.device, self._opened,
                           lambda copied: self._settled(loop, address, handle, copied), self.counters)

    def _settled(self, loop: asyncio.AbstractEventLoop, address: str, handle: str, copied: Any) -> None:
        """From the engine's thread: its copy of `handle`'s KV was queued (or never will be). With
        `forward_releases` (an engine process's), those whose copy completed go to its worker from this thread
        (flush_settled), and the event loop is not woken. Otherwise those that settle before the loop gets to them
        share one wake-up of it (an admission's copies settle together, with one event). Each wake-up took the GIL
        from the scheduler thread that settles them."""
        with self._settle_lock:
            self._settling.append((address, handle, copied))
            first = len(self._settling) == 1  # else the loop's wake-up for the others is on its way
        if self.forward_releases is not None:
            self.flush_settled()
            return
        if not first:
            return
        try:
            loop.call_soon_threadsafe(self._release_settled)
        except RuntimeError:  # the loop closed (shutting down): the prefill's TTL frees the KV
            log.info("no release for KV %s: the worker is stopping", handle)

    @property
    def settling(self) -> int:
        return len(self._settling)

    def flush_settled(self) -> None:
        """Pass the settled KVs whose copy completed to `forward_releases` (any thread: the scheduler's as it
        settles more, the engine process's timer for the last ones)."""
        done: list[tuple[str, str, Any]] = []
        with self._settle_lock:
            waiting = []
            for entry in self._settling:  # each copy's event asked once
                (done if entry[2] is None or entry[2].query() else waiting).append(entry)
            self._settling = waiting
        if done and self.forward_releases is not None:
            self.forward_releases([address for address, _, _ in done], [handle for _, handle, _ in done])

    def _release_settled(self) -> None:
        """On the loop: the KVs settled since its last wake-up released, once the copy of each has completed (one
        wait for each distinct event)."""
        with self._settle_lock:
            settled, self._settling = self._settling, []
        by_copy: dict[int, tuple[Any, list[tuple[Any, str]]]] = {}
        for address, handle, copied in settled:  # the clients made here, on the loop they belong to
            by_copy.setdefault(id(copied), (copied, []))[1].append((self.peers.client(address), handle))
        for copied, released in by_copy.values():
            self.releases.start(release_all(released, copied))

    def _start_release(self, prefill: Any, handle: str, copied: Any) -> None:
        """ReleaseKv in the background, decoding need not wait for its answer."""
        self.releases.start(release_all([(prefill, handle)], copied))

    # ---- prefill: share with the answer, answer a fetch, release what was lent ----------------------------------
    def attach_shared(self, out: Any) -> Any:
        """A prefill's last output with its KV shared over CUDA IPC in the answer where it can be (shared_now),
        so that a decode worker on this node copies it without a FetchKv round trip."""
        params = out.disaggregated_params
        if params is None or params.kv is not None or params.trtllm is not None:
            return out
        meta = self.shared_now(params.request_handle)
        return out if meta is None else replace(out, disaggregated_params=replace(params, kv=meta))

    def shared_now(self, handle: str) -> Any:
        """The KV under `handle` shared over CUDA IPC (KvMeta), to go with the prefill's answer — or None: not on a
        GPU, a transport other than auto chosen, or its copy not complete yet (never waited for here: the decode
        worker then fetches it as before)."""
        if self.setting != "auto" or not self.engine.traits.lends_kv or not self.device.startswith("cuda"):
            return None
        try:
            event = self.engine.handoff_ready(handle)
            if event is None or not event.query():
                return None
            meta, _ = self.engine.take_handoff(handle, ipc=True)
        except KeyError:
            return None
        except (RuntimeError, OSError) as exc:  # the answer still goes; a fetch then says what is wrong
            log.warning("sharing a KV with the prefill's answer failed: %s", exc)
            return None
        self._count("kv_shared_with_answer")
        return meta

    async def answer(self, call: FetchKv) -> tuple[KvMeta, bytes]:
        lends = self.engine.traits.lends_kv
        try:
            if lends and call.via in ("cuda_ipc", "nixl"):  # the copy that made the KV, finished
                await completed(self.engine.handoff_ready(call.handle))
            if call.via == "nixl" and self.nixl is not None and lends:
                kv = self.engine.lend_handoff(call.handle)
                meta = await asyncio.to_thread(self.nixl.lend, call.handle, kv, call.nixl_agent)
                self._count("kv_lent_nixl")
                return meta, b""
            return self.engine.take_handoff(call.handle, ipc=call.via == "cuda_ipc")
        except KeyError:
            raise RemoteError(f"no KV cache waiting under handle {call.handle!r}", KV_GONE) from None

    def release(self, handle: str) -> None:
        if self.nixl is not None:
            self.nixl.withdraw(handle)
        self.engine.release_handoff(handle)

    async def settle(self) -> None:
        """Wait for the releases still on their way (before the connections close)."""
        if self.forward_releases is not None:
            self.flush_settled()  # those not complete yet: the prefill's TTL frees them
        else:
            self._release_settled()  # settled, their wake-up not yet run
        await self.releases.settle()

    def close(self) -> None:
        if self.nixl is not None:
            self.nixl.close()
        if self._opened is not None:
            self._opened.close()
