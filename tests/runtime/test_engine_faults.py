"""A scheduler thread that dies is visible: requests fail with the reason, new ones are refused at once."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit


def test_a_dead_scheduler_fails_requests_instead_of_hanging(tiny):
    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256}) as engine:
            req = GenerateRequest(request_id="r", token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=4))
            assert len([o async for o in engine.generate(req)]) >= 1 and engine.failure is None

            def boom(*_):
                raise RuntimeError("injected scheduler fault")

            engine.decode._decode_step = boom  # outside the per-batch guard: what killed the thread before
            engine.core.still_running = boom
            outs = await asyncio.wait_for(_collect(engine.generate(req)), 5)
            assert outs[-1].finished and "engine failed: RuntimeError: injected scheduler fault" in outs[-1].error
            with pytest.raises(RuntimeError, match="engine failed"):
                await asyncio.wait_for(_collect(engine.generate(req)), 5)
            return engine.failure
    assert "injected scheduler fault" in asyncio.run(main())


def test_a_huge_seed_no_longer_kills_the_scheduler(tiny):
    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256}) as engine:
            # constructing a Struct does not validate (decoding does): this seed gets past the wire's check
            bad = GenerateRequest(request_id="r", token_ids=[5, 6, 7],
                                  sampling=SamplingParams(max_tokens=4, temperature=1.0, seed=2**70))
            outs = await asyncio.wait_for(_collect(engine.generate(bad)), 5)
            assert outs[-1].finish_reason == "error"  # this request fails...
            ok = GenerateRequest(request_id="s", token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3))
            outs = await asyncio.wait_for(_collect(engine.generate(ok)), 5)
            assert sum(len(o.token_ids) for o in outs) == 3 and engine.failure is None  # ...and serving goes on
    asyncio.run(main())


async def _collect(stream):
    return [o async for o in stream]
