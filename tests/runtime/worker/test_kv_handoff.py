"""The KV handoff's transports: which one a fetch asks for, and NIXL moving KV between two real agents (UCX)."""

from __future__ import annotations

import asyncio
import subprocess
import time
import sys

import msgspec
import pytest

from hpc.runtime.engine.types import EngineBase, EngineTraits
import torch

from hpc.runtime.engine.kv.nixl import nixl_available
from hpc.runtime.serve.wire import KvMeta
from hpc.runtime.worker.kv_handoff import choose_via, wants_nixl

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="needs the nixl extra (nixl-cu13)")


@pytest.mark.unit
@pytest.mark.parametrize("setting,gpu,same_node,nixl,want", [
    ("auto", True, True, True, "cuda_ipc"),  # one node's GPUs: IPC beats everything
    ("auto", True, False, True, "nixl"),  # GPUs of two nodes
    ("auto", True, False, False, "bytes"),  # ... without NIXL installed
    ("auto", False, False, True, "bytes"),  # CPU-only machines keep the bytes path
    ("auto", False, True, True, "bytes"),
    ("nixl", False, True, True, "nixl"),  # asked for: even host memory on one node
    ("bytes", True, True, True, "bytes"),
])
def test_the_transport_a_fetch_asks_for(setting, gpu, same_node, nixl, want):
    assert choose_via(setting, gpu, same_node, nixl) == want


@pytest.mark.unit
def test_who_needs_an_agent():
    assert wants_nixl("nixl", False) is True
    assert wants_nixl("auto", True) is None  # if installed
    assert wants_nixl("auto", False) is False and wants_nixl("bytes", True) is False


def _kv(length: int) -> torch.Tensor:
    return torch.randn(3, 2, 2, length, 8).to(torch.bfloat16)


@pytest.mark.unit
@needs_nixl
def test_a_lent_kv_is_read_whole_and_metadata_travels_once():
    from hpc.runtime.engine.kv.nixl import NixlTransport

    prefill, decode = NixlTransport("prefill 'x'"), NixlTransport("decode $(x)")
    try:
        first, second = _kv(17), _kv(5)
        meta = prefill.lend("h1", first, decode.known_agent("10.0.0.1:7000"))
        assert meta.nixl.metadata and meta.shape == [3, 2, 2, 17, 8] and prefill.lent == 1
        got = decode.read("10.0.0.1:7000", meta, "cpu", torch.bfloat16)
        assert torch.equal(got, first)
        assert decode.known_agent("10.0.0.1:7000") == prefill.name
        first_metadata = meta.nixl.metadata
        meta = prefill.lend("h2", second, decode.known_agent("10.0.0.1:7000"))
        assert 0 < len(meta.nixl.metadata) < len(first_metadata)  # the region only: the reader can connect
        assert torch.equal(decode.read("10.0.0.1:7000", meta, "cpu", torch.bfloat16), second)
        assert prefill.withdraw("h1") and prefill.withdraw("h2") and not prefill.withdraw("h2")
        assert prefill.lent == 0
    finally:
        prefill.close()
        decode.close()


CHILD = """
import sys, msgspec, torch
from hpc.runtime.engine.kv.nixl import NixlTransport
torch.manual_seed(0)
kv = torch.randn(4, 2, 2, 2000, 16)
lender = NixlTransport("child")
print("META", msgspec.msgpack.encode(lender.lend("h", kv)).hex(), flush=True)  # nixl logs to stdout too
sys.stdin.readline()
print("RESULT", "withdrawn" if lender.withdraw("h") else "missing", flush=True)
"""


def _tagged(child: subprocess.Popen, tag: str) -> str:
    for line in child.stdout:
        if line.startswith(tag + " "):
            return line.split(" ", 1)[1].strip()
    raise AssertionError(f"the child exited before printing {tag}")


@pytest.mark.unit
@needs_nixl
def test_another_process_reads_the_lent_kv():
    from hpc.runtime.engine.kv.nixl import NixlTransport

    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    reader = NixlTransport("reader")
    try:
        meta = msgspec.msgpack.decode(bytes.fromhex(_tagged(child, "META")), type=KvMeta)
        assert meta.nixl is not None and meta.ipc is None and meta.shape == [4, 2, 2, 2000, 16]
        got = reader.read("child:1", meta, "cpu", torch.float32)
        child.stdin.write("done\n")
        child.stdin.flush()
        assert _tagged(child, "RESULT") == "withdrawn"
    finally:
        child.stdin.close()
        child.wait(30)
        reader.close()
    torch.manual_seed(0)
    assert torch.equal(got, torch.randn(4, 2, 2, 2000, 16))


@pytest.mark.unit
def test_a_cuda_ipc_handle_keeps_every_byte():
    """The driver's 64-byte handle is mostly NULs: a char array would cut it at the first one."""
    from hpc.runtime.engine.kv.cuda_ipc import _Handle

    raw = b"\x00\x01" + b"\x00" * 30 + bytes(range(32))
    assert bytes(_Handle.of(raw).reserved) == raw
    with pytest.raises(ValueError, match="64 bytes"):
        _Handle.of(raw[:63])


class FakeDriver:
    """libcuda's IPC calls as OpenAllocations makes them (cuda.h: cuIpcOpenMemHandle_v2, cuIpcCloseMemHandle)."""

    def __init__(self) -> None:
        self.opened: list[bytes] = []
        self.closed: list[int] = []

    def cuIpcOpenMemHandle_v2(self, pointer_ref, handle, flags) -> int:
        self.opened.append(bytes(handle.reserved))
        pointer_ref._obj.value = 0x10000 * len(self.opened)
        return 0

    def cuIpcCloseMemHandle(self, base: int) -> int:
        self.closed.append(base)
        return 0


@pytest.mark.unit
def test_open_allocations_are_reused_and_the_oldest_or_idle_ones_closed(monkeypatch):
    from hpc.runtime.engine.kv import cuda_ipc
    from hpc.runtime.serve.wire import CudaIpc

    driver = FakeDriver()
    monkeypatch.setattr(cuda_ipc._Driver, "use", classmethod(lambda cls, device: driver))
    clock = [1000.0]
    monkeypatch.setattr(cuda_ipc.time, "monotonic", lambda: clock[0])
    opened = cuda_ipc.OpenAllocations(limit=2)
    gpu = torch.device("cuda", 0)

    def at(handle: int, offset: int) -> int:
        return opened.pointer(CudaIpc(device=0, handle=bytes([handle]) * 64, allocation_bytes=1 << 20,
                                      offset_bytes=offset, size_bytes=64), gpu)

    assert at(1, 0) == 0x10000 and at(1, 512) == 0x10000 + 512  # a reused allocation: opened once
    assert at(2, 0) == 0x20000 and opened.opened == 2 and driver.closed == []
    assert opened.open_seconds > 0  # the two opens were timed, the reuse was not an open
    assert at(1, 8) == 0x10000 + 8  # used again: now the newest
    at(3, 0)  # over the limit: the least recently used (2) is closed, not 1
    assert driver.closed == [0x20000] and opened.open_count == 2
    clock[0] += cuda_ipc.IDLE_CLOSE_S + 1
    at(3, 0)  # 1 sat idle past the limit: closed, though there is room
    assert driver.closed == [0x20000, 0x10000] and opened.open_count == 1
    opened.close()
    assert driver.closed[-1] == 0x30000 and opened.open_count == 0
    with pytest.raises(ValueError, match="outside their allocation"):  # a bad description reads nothing
        opened.pointer(CudaIpc(device=0, handle=bytes([4]) * 64, allocation_bytes=100, offset_bytes=64,
                               size_bytes=64), gpu)
    assert opened.opened == 3


@pytest.mark.unit
@needs_nixl
def test_a_process_with_a_nixl_agent_exits_cleanly():
    """UCX's ib module, loaded on a machine without InfiniBand, made every such process die at exit (SIGSEGV in the
    wheel's libnl): a worker's exit status must say how its work went, not that."""
    code = "from hpc.runtime.engine.kv.nixl import NixlTransport; NixlTransport('exit-check')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.unit
def test_held_kv_is_taken_once_lent_until_released_and_expires():
    from hpc.runtime.engine.kv.pack import HeldKv, unpack

    held = HeldKv(ttl_s=60.0)
    a, b, c = _kv(3), _kv(4), _kv(5)
    held.put_all([("a", a), ("b", b), ("c", c)])
    meta, data = held.take("a", ipc=True)  # host memory: IPC is not possible, bytes it is, taken at once
    assert meta.ipc is None and torch.equal(unpack(meta, bytearray(data)), a)
    with pytest.raises(KeyError):
        held.take("a")
    assert held.lend("b") is b and held.lend("b") is b and len(held) == 2  # lent: still held
    held.release("b")
    held.release("b")  # twice: harmless
    assert len(held) == 1
    held.ttl_s = 0.0
    held.expire()  # nobody came for "c"
    assert len(held) == 0
    held.put_all([("d", _kv(2))])
    held.expire()  # looked a moment ago: the next look is a second away (the scheduler calls it at every step)
    assert len(held) == 1
    held._next_look = 0.0
    held.expire()
    assert len(held) == 0


class _PrefillPeer:
    """The prefill worker's end of the RPC as the decode side sees it: answers FetchKv, records ReleaseKv."""

    def __init__(self, copy: "_CopyEvent") -> None:
        self.copy = copy
        self.calls: list[str] = []
        self.released: list[str] = []
        self.released_while_copying = False

    def client(self, address: str) -> "_PrefillPeer":
        return self

    async def call(self, body):
        from hpc.runtime.serve.wire import CudaIpc, FetchKv, ReleaseKv

        self.calls.append(type(body).__name__)
        if isinstance(body, FetchKv):
            ipc = CudaIpc(device=0, handle=b"\0" * 64, allocation_bytes=64, offset_bytes=0, size_bytes=64)
            return KvMeta(shape=[2, 2, 2, 2, 2], dtype="torch.bfloat16", ipc=ipc), b""
        assert isinstance(body, ReleaseKv)
        self.released.append(body.handle)
        self.released_while_copying |= self.copy.pending >= 0
        return None, b""


class _Peers:
    """Prefill workers' RPC clients by address, as Peers.client gives them."""

    def __init__(self, by_address: dict[str, "_PrefillPeer"]) -> None:
        self.by_address = by_address

    def client(self, address: str) -> "_PrefillPeer":
        return self.by_address[address]


class _CopyEvent:
    """A CUDA event's query(): the queued copy completes after `pending` more polls."""

    def __init__(self, pending: int) -> None:
        self.pending = pending

    def query(self) -> bool:
        self.pending -= 1
        return self.pending < 0


@pytest.mark.unit
def test_a_cuda_ipc_fetch_returns_at_once_and_releases_the_prefills_kv_only_after_the_copy(monkeypatch):
    import asyncio

    from hpc.runtime.engine.kv import pack as kvmod
    from hpc.runtime.serve.wire import DisaggregatedParams
    from hpc.runtime.worker.kv_handoff import KvHandoff

    copy = _CopyEvent(pending=3)
    landed = torch.zeros(2, 2, 2, 2, 2)
    monkeypatch.setattr(kvmod, "copy_shared", lambda metas, device, opened: ([landed] * len(metas), copy))
    prefill = _PrefillPeer(copy)
    handoff = KvHandoff(setting="auto", device="cuda:1", host="10.0.0.1", engine=None, peers=prefill, counters={})

    async def main():
        pending = await handoff.fetch(DisaggregatedParams(request_handle="h-1", prefill_address="10.0.0.1:7000",
                                                          first_token_id=5, prompt_length=2))
        await asyncio.sleep(0.01)
        before_admission = list(prefill.calls)  # nothing copied yet, so nothing released
        # the engine's scheduler thread copies it as it admits the request, and calls back to this loop
        (kv,) = await asyncio.to_thread(kvmod.take_all, [pending])
        still_copying = copy.pending >= 0  # returned with the copy queued, not waited for
        await asyncio.sleep(0.01)
        await handoff.settle()
        return before_admission, kv, still_copying

    before_admission, kv, still_copying = asyncio.run(main())
    assert before_admission == ["FetchKv"]
    assert kv is landed and handoff.counters["kv_fetched_cuda_ipc"] == 1 and still_copying
    assert prefill.calls == ["FetchKv", "ReleaseKv"] and prefill.released == ["h-1"]
    assert not prefill.released_while_copying  # the copy reads the prefill's memory until it completes
    assert handoff.counters["kv_move_seconds_total"] > 0


@pytest.mark.unit
def test_the_kvs_an_admission_settles_together_cost_the_event_loop_one_wake_up(monkeypatch):
    """Each wake-up of a decode engine's loop takes the GIL from its scheduler thread: an admission's KVs (one
    copy event) and a dropped one, settled on the scheduler's thread before the loop runs, are released in one
    wake-up, each once, none before its copy completed; the event is waited for once."""
    import asyncio

    from hpc.runtime.worker.kv_handoff import KvHandoff

    copy = _CopyEvent(pending=2)
    prefill, other = _PrefillPeer(copy), _PrefillPeer(copy)  # another prefill worker's KVs: never copied
    peers = _Peers({"10.0.0.1:7000": prefill, "10.0.0.2:7000": other})
    handoff = KvHandoff(setting="auto", device="cuda:1", host="10.0.0.1", engine=None, peers=peers, counters={})
    polls = []
    monkeypatch.setattr(copy, "query", lambda query=copy.query: polls.append(1) or query())

    async def main():
        loop, wakeups = asyncio.get_running_loop(), []

        class CountingLoop:
            def call_soon_threadsafe(self, callback, *args):
                wakeups.append(callback)
                return loop.call_soon_threadsafe(callback, *args)

        # the scheduler thread's admission, all settled before the loop runs again (called here, where the loop
        # cannot run in between: on another thread it may, and then wakes up twice)
        for handle in ("h-1", "h-2", "h-3"):
            handoff._settled(CountingLoop(), "10.0.0.1:7000", handle, copy)
        handoff._settled(CountingLoop(), "10.0.0.2:7000", "h-4", None)  # dropped: never copied
        await asyncio.sleep(0.02)
        await asyncio.to_thread(handoff._settled, CountingLoop(), "10.0.0.2:7000", "h-5", None)  # a later one
        await handoff.settle()
        return wakeups

    wakeups = asyncio.run(main())
    assert len(wakeups) == 2 and sorted(prefill.released) == ["h-1", "h-2", "h-3"]
    assert other.released == ["h-4", "h-5"] and other.released_while_copying  # not waited for: nothing to wait
    assert not prefill.released_while_copying and len(polls) == 3  # one wait: polled until it completed


@pytest.mark.unit
def test_an_engine_process_passes_completed_copies_to_its_worker_without_waking_its_loop():
    """forward_releases (an engine process's): the scheduler thread, as it settles KVs, sends those whose copy
    completed to the worker (ReleaseKvs), none before; the loop is never woken for them and sends no ReleaseKv
    itself; the last ones go with flush_settled (the process's timer) once complete."""
    import threading

    from hpc.runtime.worker.kv_handoff import KvHandoff

    first, second = _CopyEvent(pending=1), _CopyEvent(pending=5)
    prefill = _PrefillPeer(first)
    handoff = KvHandoff(setting="auto", device="cuda:1", host="10.0.0.1", engine=None, peers=prefill, counters={})
    sent, senders = [], set()

    def forward(addresses, handles):
        sent.append(list(zip(addresses, handles)))
        senders.add(threading.get_ident())

    handoff.forward_releases = forward

    class NoLoop:
        def call_soon_threadsafe(self, *args):
            raise AssertionError("the event loop was woken")

    def scheduler():
        handoff._settled(NoLoop(), "10.0.0.1:7000", "h-1", first)  # copy queued: not complete yet
        handoff._settled(NoLoop(), "10.0.0.2:7000", "h-2", None)  # dropped: nothing to wait for
        handoff._settled(NoLoop(), "10.0.0.1:7000", "h-3", second)  # the next admission's

    worker = threading.Thread(target=scheduler)
    worker.start()
    worker.join()
    # nothing as h-1 settles (its copy not complete); with h-2, both (h-1's copy complete when polled again);
    # h-3's copy not yet
    assert sent == [[("10.0.0.1:7000", "h-1"), ("10.0.0.2:7000", "h-2")]] and senders == {worker.ident}
    assert handoff.settling == 1
    handoff.flush_settled()
    assert len(sent) == 1  # still copying
    second.pending = 0
    handoff.flush_settled()
    assert sent[-1] == [("10.0.0.1:7000", "h-3")] and handoff.settling == 0 and prefill.calls == []


@pytest.mark.unit
def test_a_kv_whose_request_ended_before_admission_is_released_without_a_copy(monkeypatch):
    import asyncio

    from hpc.runtime.engine.kv import pack as kvmod
    from hpc.runtime.serve.wire import DisaggregatedParams
    from hpc.runtime.worker.kv_handoff import KvHandoff

    copies = []
    monkeypatch.setattr(kvmod, "copy_shared", lambda *args: copies.append(args))
    prefill = _PrefillPeer(_CopyEvent(pending=0))
    handoff = KvHandoff(setting="auto", device="cuda:1", host="10.0.0.1", engine=None, peers=prefill, counters={})

    async def main():
        pending = await handoff.fetch(DisaggregatedParams(request_handle="h-1", prefill_address="10.0.0.1:7000",
                                                          first_token_id=5, prompt_length=2))
        await asyncio.to_thread(pending.drop)  # cancelled before the scheduler admitted it
        await asyncio.to_thread(pending.drop)  # settled once, whatever calls it again
        await asyncio.sleep(0.01)
        await handoff.settle()

    asyncio.run(main())
    assert copies == [] and prefill.calls == ["FetchKv", "ReleaseKv"] and prefill.released == ["h-1"]


@pytest.mark.unit
def test_a_decode_worker_connects_to_the_prefill_workers_it_learns_of_before_their_first_handoff():
    import asyncio

    from hpc.runtime.services.discovery import Instance
    from hpc.runtime.worker.handlers import Peers

    async def main():
        accepted = []

        async def prefill_side(reader, writer):
            accepted.append(await reader.read(1))
        server = await asyncio.start_server(prefill_side, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        peers = Peers(token="t")
        peers.instances = {"prefill/0": Instance(role="prefill", index=0, instance_id="p", host="127.0.0.1",
                                                 rpc_port=port, http_port=1, node="n"),
                           "decode/1": Instance(role="decode", index=1, instance_id="d", host="127.0.0.1",
                                                rpc_port=1, http_port=1, node="n")}
        peers.preconnect(("prefill", "encode"))
        for _ in range(200):
            if accepted:
                break
            await asyncio.sleep(0.01)
        address = f"127.0.0.1:{port}"
        state = (len(accepted), peers.client(address).connected, sorted(peers.clients) == [address])
        await peers.close()
        server.close()
        return state

    assert asyncio.run(main()) == (1, True, True)  # the prefill connected ahead; the other decode worker not


class _PrefillEngine(EngineBase):
    """The prefill engine's handoff calls as KvHandoff.answer makes them; its KV's copy completes after 3 polls."""

    traits = EngineTraits(lends_kv=True)

    def __init__(self) -> None:
        self.copy = _CopyEvent(pending=3)
        self.taken_while_copying: bool | None = None

    def handoff_ready(self, handle: str) -> _CopyEvent:
        assert handle == "h-2"
        return self.copy

    def take_handoff(self, handle: str, ipc: bool = False):
        self.taken_while_copying = self.copy.pending >= 0  # take() would block the event loop on the GPU
        return KvMeta(shape=[1], dtype="torch.bfloat16"), b""


@pytest.mark.unit
def test_a_prefill_answers_a_cuda_ipc_fetch_once_its_copy_completed_without_blocking_its_event_loop():
    import asyncio

    from hpc.runtime.serve.wire import FetchKv
    from hpc.runtime.worker.kv_handoff import KvHandoff

    engine = _PrefillEngine()
    handoff = KvHandoff(setting="auto", device="cuda:0", host="10.0.0.1", engine=engine, peers=None, counters={})

    async def main():
        ticks = 0

        async def ticker():  # the event loop keeps running other work meanwhile
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        task = asyncio.create_task(ticker())
        meta, _ = await handoff.answer(FetchKv(handle="h-2", via="cuda_ipc"))
        task.cancel()
        return meta, ticks

    meta, ticks = asyncio.run(main())
    assert meta.shape == [1] and engine.taken_while_copying is False and ticks > 0


@pytest.mark.unit
def test_a_kv_shared_with_the_prefills_answer_is_copied_without_asking_and_released_after_the_copy(monkeypatch):
    import asyncio

    from hpc.runtime.engine.kv import pack as kvmod
    from hpc.runtime.serve.wire import CudaIpc, DisaggregatedParams
    from hpc.runtime.worker.kv_handoff import KvHandoff

    copy = _CopyEvent(pending=3)
    landed, seen = torch.zeros(2, 2, 2, 2, 2), []
    monkeypatch.setattr(kvmod, "copy_shared",
                        lambda metas, device, opened: seen.extend(metas) or ([landed] * len(metas), copy))
    ipc = CudaIpc(device=0, handle=b"\1" * 64, allocation_bytes=64, offset_bytes=0, size_bytes=64)
    shared = KvMeta(shape=[2, 2, 2, 2, 2], dtype="torch.bfloat16", ipc=ipc)

    def fetch(setting: str, host: str):
        prefill = _PrefillPeer(copy)
        handoff = KvHandoff(setting=setting, device="cuda:1", host=host, engine=None, peers=prefill, counters={})
        params = DisaggregatedParams(request_handle="h-1", prefill_address="10.0.0.1:7000", first_token_id=5,
                                     prompt_length=2, kv=shared)

        async def main():
            (kv,) = kvmod.take_all([await handoff.fetch(params)])
            await asyncio.sleep(0.01)  # the release, called back to this loop
            await handoff.settle()
            return kv
        return asyncio.run(main()), prefill, handoff.counters

    kv, prefill, counters = fetch("auto", "10.0.0.1")
    assert kv is landed and seen == [shared] and prefill.calls == ["ReleaseKv"]  # no FetchKv
    assert counters["kv_taken_from_answer"] == 1 and not prefill.released_while_copying
    copy.pending = 3
    _, prefill, counters = fetch("auto", "10.0.0.2")  # another node: the handle is of no use there, ask
    assert prefill.calls[0] == "FetchKv" and "kv_taken_from_answer" not in counters


@pytest.mark.unit
@pytest.mark.parametrize("setting,device,polls,shared", [
    ("auto", "cuda:0", 0, True),  # the copies were complete when the answer left (read with the first tokens)
    ("auto", "cuda:0", 2, False),  # not yet: never waited for here, the decode worker asks as before
    ("bytes", "cuda:0", 0, False),  # a transport chosen: kept to it
    ("auto", "cpu", 0, False),  # host memory: no CUDA IPC
])
def test_a_prefill_shares_its_kv_with_the_answer_only_when_it_is_complete_on_a_gpu(setting, device, polls, shared):
    from hpc.runtime.worker.kv_handoff import KvHandoff

    engine = _PrefillEngine()
    engine.copy.pending = polls
    handoff = KvHandoff(setting=setting, device=device, host="10.0.0.1", engine=engine, peers=None, counters={})
    meta = handoff.shared_now("h-2")
    assert (meta is not None) == shared and (engine.taken_while_copying is False if shared else
                                            engine.taken_while_copying is None)
    assert handoff.counters.get("kv_shared_with_answer", 0) == int(shared)


class _SilentPrefill:
    """A prefill worker whose KV never comes (a wedged transfer, a route that drops the answer)."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def call(self, message):
        from hpc.runtime.serve.wire import ReleaseKv

        if isinstance(message, ReleaseKv):
            self.released.append(message.handle)
            return None, b""
        await asyncio.sleep(3600)


@pytest.mark.unit
def test_a_kv_transfer_past_its_deadline_fails_its_request_counted_and_released():
    from types import SimpleNamespace

    from hpc.runtime.serve.rpc import RemoteError
    from hpc.runtime.worker.kv_handoff import KvHandoff, TransferDeadline

    prefill = _SilentPrefill()
    peers = SimpleNamespace(client=lambda address: prefill)
    counters: dict[str, float] = {}
    handoff = KvHandoff(setting="bytes", device="cpu", host="10.0.0.2", engine=None, peers=peers, counters=counters,
                        deadline=TransferDeadline(min_s=0.3, floor_gb_s=1.0))
    params = SimpleNamespace(prefill_address="10.0.0.1:7000", request_handle="h1", kv=None)

    async def fetch():
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as failed:
            await handoff.fetch(params)
        await handoff.settle()
        return time.monotonic() - t0, failed.value
    took, error = asyncio.run(fetch())
    assert 0.3 <= took < 2.0  # its deadline, not the hour the prefill would take
    assert error.code == 504 and "prefill worker 10.0.0.1:7000 passed its deadline" in str(error)
    assert "runtime.kv_transfer_min_s 0.3" in str(error)
    assert counters["kv_transfer_timeouts_total"] == 1 and handoff.timeouts_by_prefill == {"10.0.0.1:7000": 1}
    assert prefill.released == ["h1"]  # the prefill may free what it held for it


@pytest.mark.unit
def test_a_transfers_deadline_grows_with_its_size():
    from hpc.runtime.worker.kv_handoff import TransferDeadline, _nbytes

    meta = KvMeta(shape=[32, 2, 8, 1024, 128], dtype="bfloat16")
    assert _nbytes(meta) == 32 * 2 * 8 * 1024 * 128 * 2
    assert TransferDeadline(10.0, 0.5).seconds(_nbytes(meta)) == pytest.approx(10.0 + 134217728 / 0.5e9)


class _DeadPrefill:
    """A prefill worker killed after it answered with the KV's handle: its connection is gone."""

    async def call(self, message):
        from hpc.runtime.serve.rpc import PeerGone

        raise PeerGone("connection to 10.0.0.1:7000 lost")


@pytest.mark.unit
def test_a_fetch_from_a_prefill_worker_that_died_says_the_kv_is_gone_so_the_frontend_prefills_again():
    from types import SimpleNamespace

    from hpc.runtime.serve.rpc import KV_GONE, RemoteError
    from hpc.runtime.worker.kv_handoff import KvHandoff

    counters: dict[str, float] = {}
    handoff = KvHandoff(setting="bytes", device="cpu", host="10.0.0.2", engine=None,
                        peers=SimpleNamespace(client=lambda address: _DeadPrefill()), counters=counters)
    params = SimpleNamespace(prefill_address="10.0.0.1:7000", request_handle="h1", kv=None)
    with pytest.raises(RemoteError) as failed:
        asyncio.run(handoff.fetch(params))
    assert failed.value.code == KV_GONE and "prefill worker 10.0.0.1:7000 holding the KV is gone" in str(failed.value)
    assert counters["kv_prefill_gone_total"] == 1
