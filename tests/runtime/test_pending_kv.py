"""A decode engine takes the KVs shared over CUDA IPC when it admits their requests (kv.PendingCopy), all of an
admission's at once, on its scheduler thread; a request that ends before admission gives its KV back uncopied.
Here on CPU: the copy (kv.copy_shared) stood in for by one that hands over the KV a prefill engine in this process
made, and records which thread asked and for how many."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hpc.runtime.engine.kv import pack as kvpack
from hpc.runtime.engine.torch.sequence import Seq
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import (DisaggregatedParams, DisaggregationMode, GenerateRequest,
                                      SamplingParams)

pytestmark = pytest.mark.unit

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
ARGS = {"max_seq_len": 64, "max_batch_size": 4}


class Copies:
    """kv.copy_shared's stand-in: each call's thread and KV count; the KVs are the metas themselves (tensors)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def __call__(self, metas, device, opened):
        self.calls.append((threading.current_thread().name, len(metas)))
        if self.fail:
            raise RuntimeError("cuIpcOpenMemHandle failed: invalid handle")
        return list(metas), "the copies' event"


def _pending(kv, settled: list) -> kvpack.PendingCopy:
    return kvpack.PendingCopy(kv, "cuda:1", OPENED, settled.append, {})


class _Opened:
    opened, open_seconds = 1, 0.0


OPENED = _Opened()


def _request(max_tokens: int, params=None) -> GenerateRequest:
    return GenerateRequest(request_id="r", token_ids=PROMPT, disaggregated_params=params,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def _aggregated_and_prefilled(tiny):
    """The aggregated engine's greedy answer, a prefill engine's answer (its first token) and the KV it made."""
    async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, ARGS) as agg:
        whole = [t async for out in agg.generate(_request(8)) for t in out.token_ids]
    async with TorchEngine(tiny, DisaggregationMode.PREFILL, ARGS) as prefill:
        first = [out async for out in prefill.generate(_request(1))][-1]
        meta, data = prefill.take_handoff(first.disaggregated_params.request_handle)
    return whole, first, kvpack.unpack(meta, data)


def test_the_decode_engine_copies_shared_kvs_on_its_scheduler_thread_as_it_admits_them(tiny, monkeypatch):
    copies, settled = Copies(), []
    monkeypatch.setattr(kvpack, "copy_shared", copies)

    async def main():
        whole, first, kv = await _aggregated_and_prefilled(tiny)

        async def fetch(params):
            return _pending(kv, settled)

        async with TorchEngine(tiny, DisaggregationMode.DECODE, ARGS, fetch_kv=fetch) as decode:
            rest = [t async for out in decode.generate(_request(8, first.disaggregated_params))
                    for t in out.token_ids]
        return whole, first.token_ids + rest

    whole, disaggregated = asyncio.run(main())
    assert disaggregated == whole and len(whole) == 8  # the KV went in whole
    assert copies.calls == [("torch-engine", 1)]  # copied by the scheduler, not on the event loop
    assert settled == ["the copies' event"]  # the owner told once, with what the copy completes with


def test_an_admissions_arrivals_are_copied_in_one_go_and_a_failed_copy_ends_them(tiny, monkeypatch):
    async def admit(copies: Copies, kvs: list):
        monkeypatch.setattr(kvpack, "copy_shared", copies)
        settled: list = []
        async with TorchEngine(tiny, DisaggregationMode.DECODE, ARGS) as decode:
            # what the scheduler thread would do with three arrivals, the engine's own thread kept out of it
            decode._running = False
            decode._inbox.put(None)
            await asyncio.to_thread(decode._thread.join, 5)
            ended: list = []
            seqs = [Seq(request=_request(8, DisaggregatedParams(request_handle=f"h-{i}", prefill_address="n1:7000",
                                                                first_token_id=5, prompt_length=kv.shape[3])),
                        emit=ended.append, imported_kv=_pending(kv, settled)) for i, kv in enumerate(kvs)]
            running: list = []
            decode._admit(seqs, running)
            return seqs, running, settled, ended, len(decode.core.slots.free)

    import torch

    kvs = [torch.zeros(2, 2, 2, n, 32) for n in (8, 9, 10)]  # the tiny model's [layers, 2, kv heads, T, d]
    copies = Copies()
    seqs, running, settled, ended, free = asyncio.run(admit(copies, kvs))
    assert copies.calls == [("MainThread", 3)]  # one copy call for the three
    assert [s.imported_kv for s in seqs] == [None] * 3 and running == seqs  # imported, decoding
    assert settled == ["the copies' event"] * 3 and free == ARGS["max_batch_size"] - 3

    copies = Copies(fail=True)
    seqs, running, settled, ended, free = asyncio.run(admit(copies, kvs))
    assert copies.calls == [("MainThread", 3)] and running == [] and free == ARGS["max_batch_size"]
    assert settled == [None] * 3  # nothing copied: the owners may free them at once
    assert [out.finish_reason for out in ended] == ["error"] * 3 and "invalid handle" in ended[0].error


def test_a_request_that_ends_before_admission_gives_its_kv_back_uncopied(tiny, monkeypatch):
    copies = Copies()
    monkeypatch.setattr(kvpack, "copy_shared", copies)

    async def main():
        async with TorchEngine(tiny, DisaggregationMode.DECODE, ARGS) as decode:
            gone, failed = [], []
            seq = Seq(request=_request(8), emit=lambda out: None, imported_kv=_pending(None, gone))
            seq.cancelled = True
            decode._admit([seq], [])  # the scheduler skips it: cancelled while it waited in the inbox
            other = Seq(request=_request(8), emit=lambda out: None, imported_kv=_pending(None, failed))
            decode.core.finish(other, "error", error="engine failed")  # ended without a slot
            return gone, failed, seq, other

    gone, failed, seq, other = asyncio.run(main())
    assert copies.calls == [] and gone == [None] and failed == [None]
    assert seq.imported_kv is None and other.imported_kv is None


class SlotCopies:
    """kv.copy_shared_into's stand-in: the KV behind each meta (by its fake handle) written into its slot, as the
    driver's 3D copy does on a GPU; each call's thread and slots."""

    def __init__(self, kvs: dict[bytes, "object"]) -> None:
        self.kvs, self.calls = kvs, []

    def __call__(self, metas, whole, slots, opened):
        self.calls.append((threading.current_thread().name, list(slots)))
        for meta, slot in zip(metas, slots):
            kv = self.kvs[meta.ipc.handle]
            whole[:, :, slot, :, :kv.shape[3]] = kv
        return "the copies' event"


def _shared_meta(kv, handle: bytes):
    from hpc.runtime.serve.wire import CudaIpc, KvMeta

    size = kv.numel() * kv.element_size()
    return KvMeta(shape=list(kv.shape), dtype=str(kv.dtype),
                  ipc=CudaIpc(device=0, handle=handle, allocation_bytes=size, offset_bytes=0, size_bytes=size))


def test_a_kv_that_fits_the_cache_goes_straight_into_its_slot(tiny, monkeypatch):
    """One rank, the cache's dtype and heads: no buffer, no scatter (kv.take_all into the slots); the greedy text
    is the aggregated engine's. A KV in another dtype goes through a buffer and the scatter, as before."""
    buffered = Copies()
    monkeypatch.setattr(kvpack, "copy_shared", buffered)

    async def main():
        whole, first, kv = await _aggregated_and_prefilled(tiny)
        slotted = SlotCopies({b"h" * 64: kv})
        monkeypatch.setattr(kvpack, "copy_shared_into", slotted)
        settled, counters = [], {}

        async def fetch(params):
            return kvpack.PendingCopy(_shared_meta(kv, b"h" * 64), "cuda:1", OPENED, settled.append, counters)

        async with TorchEngine(tiny, DisaggregationMode.DECODE, ARGS, fetch_kv=fetch) as decode:
            rest = [t async for out in decode.generate(_request(8, first.disaggregated_params))
                    for t in out.token_ids]
            fits = kvpack.fits_slot(_shared_meta(kv, b"h" * 64), decode.core.cache.whole)
            other_dtype = kvpack.fits_slot(_shared_meta(kv.to(torch.float16), b"h" * 64), decode.core.cache.whole)
            longer = kvpack.fits_slot(_shared_meta(torch.zeros(*kv.shape[:3], ARGS["max_seq_len"] + 1, kv.shape[4]),
                                                   b"h" * 64), decode.core.cache.whole)
        return whole, first.token_ids + rest, slotted, settled, counters, (fits, other_dtype, longer)

    import torch

    whole, disaggregated, slotted, settled, counters, fits = asyncio.run(main())
    assert disaggregated == whole and len(whole) == 8  # the KV went in whole, straight into the slot
    assert [thread for thread, _ in slotted.calls] == ["torch-engine"] and buffered.calls == []
    assert settled == ["the copies' event"] and counters["kv_ipc_copied_into_slots"] == 1
    assert fits == (True, False, False)


def test_copies_into_the_cache_need_a_slot_each():
    import torch

    settled: list = []
    pending = [_pending(torch.zeros(2, 2, 2, 4, 32), settled) for _ in range(2)]
    with pytest.raises(ValueError, match="a slot each"):
        kvpack.take_all(pending, torch.zeros(2, 2, 3, 2, 8, 32), [0])
    assert settled == []  # nothing queued: the engine's admission ends them, which gives each back once
