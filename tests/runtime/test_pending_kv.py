"""A decode engine takes a KV shared over CUDA IPC when it admits the request (kv.PendingCopy), on its scheduler
thread; a request that ends before admission gives the KV back uncopied. Here on CPU, the copy stood in for by a
PendingCopy whose take() hands over the KV a prefill engine in this process made."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hpc.runtime.engine import kv as kvpack
from hpc.runtime.engine.sequence import Seq
from hpc.runtime.engine.torch_engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
ARGS = {"max_seq_len": 64, "max_batch_size": 4}


class HandedOver(kvpack.PendingCopy):
    """What the decode worker's KvHandoff.fetch returns for a CUDA IPC KV, with the copy replaced by the tensor."""

    def __init__(self, kv) -> None:
        self.kv, self.settled_with, self.taken_on = kv, [], None
        super().__init__(meta=None, device="cpu", opened=None, settled=self.settled_with.append, counters={})

    def take(self):
        self.taken_on = threading.current_thread().name
        self._settle("the copy's event")
        return self.kv


def _request(max_tokens: int, params=None) -> GenerateRequest:
    return GenerateRequest(request_id="r", token_ids=PROMPT, disaggregated_params=params,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def test_the_decode_engine_copies_a_shared_kv_on_its_scheduler_thread_as_it_admits_the_request(tiny):
    pending: list[HandedOver] = []

    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, ARGS) as agg:
            whole = [t async for out in agg.generate(_request(8)) for t in out.token_ids]
        async with TorchEngine(tiny, DisaggregationMode.PREFILL, ARGS) as prefill:
            first = [out async for out in prefill.generate(_request(1))][-1]
            meta, data = prefill.take_handoff(first.disaggregated_params.request_handle)
        kv = kvpack.unpack(meta, data)

        async def fetch(params):
            pending.append(HandedOver(kv))
            return pending[-1]

        async with TorchEngine(tiny, DisaggregationMode.DECODE, ARGS, fetch_kv=fetch) as decode:
            rest = [t async for out in decode.generate(_request(8, first.disaggregated_params))
                    for t in out.token_ids]
        return whole, first.token_ids + rest

    whole, disaggregated = asyncio.run(main())
    assert disaggregated == whole and len(whole) == 8  # the KV went in whole
    assert pending[0].taken_on == "torch-engine"  # copied by the scheduler, not on the event loop
    assert pending[0].settled_with == ["the copy's event"]  # the owner told once, with what the copy ends with


def test_a_request_that_ends_before_admission_gives_its_kv_back_uncopied(tiny):
    async def main():
        async with TorchEngine(tiny, DisaggregationMode.DECODE, ARGS) as decode:
            gone, failed = HandedOver(None), HandedOver(None)
            seq = Seq(request=_request(8), emit=lambda out: None, imported_kv=gone)
            seq.cancelled = True
            decode._admit([seq], [])  # the scheduler skips it: cancelled while it waited in the inbox
            other = Seq(request=_request(8), emit=lambda out: None, imported_kv=failed)
            decode._finish(other, "error", error="engine failed")  # ended without a slot
            return gone, failed, seq, other

    gone, failed, seq, other = asyncio.run(main())
    assert gone.taken_on is None and gone.settled_with == [None] and seq.imported_kv is None
    assert failed.taken_on is None and failed.settled_with == [None] and other.imported_kv is None
