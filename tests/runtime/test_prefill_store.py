"""A prefill worker stores its prompts into the prefix cache once nothing waits: a request that arrived during a
step is prefilled before the prompts of that step are stored, and a slot whose prompt is not stored yet is never
prefilled over before the store has copied it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hpc.runtime.engine.torch_engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit

BLOCK = 32
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a CUDA GPU")])
FIRST = [11 + i % 50 for i in range(40)]  # one whole block of 32 and 8 more
SECOND = [900 + i % 70 for i in range(40)]


def _request(rid: str, ids: list[int]) -> GenerateRequest:
    return GenerateRequest(request_id=rid, token_ids=ids, streaming=False,
                           sampling=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))


async def _second_arrives_during_the_first(engine: TorchEngine, order: list[str]) -> dict[str, torch.Tensor]:
    """FIRST is prefilled; SECOND reaches the inbox while that step runs. Each prompt's KV as handed over."""
    prefill, store = engine._prefill, engine._store_prompts
    first_running, second_queued = threading.Event(), threading.Event()

    def traced_prefill(group):
        order.append("prefill " + ",".join(seq.request.request_id for seq, _ in group))
        if not first_running.is_set():
            first_running.set()
            assert second_queued.wait(10)  # the scheduler thread holds here until SECOND is in the inbox
        return prefill(group)

    engine._prefill = traced_prefill
    engine._store_prompts = lambda: (order.append(f"store {len(engine._unstored)}"), store())[1]
    kvs: dict[str, torch.Tensor] = {}

    async def answer(rid: str, ids: list[int]) -> None:
        answers: list = []
        await engine.stream(_request(rid, ids), answers.append)
        handle = answers[-1].disaggregated_params.request_handle
        kvs[rid] = engine.lend_handoff(handle).clone()
        engine.release_handoff(handle)

    first = asyncio.create_task(answer("first", FIRST))
    await asyncio.to_thread(first_running.wait, 10)
    second = asyncio.create_task(answer("second", SECOND))
    await asyncio.sleep(0)  # the task runs up to its submit, which enqueues it without awaiting anything
    assert engine._inbox.qsize() == 1
    second_queued.set()
    await asyncio.gather(first, second)
    for _ in range(100):  # the deferred store runs once the scheduler finds nothing waiting
        if not engine._unstored:
            break
        await asyncio.sleep(0.01)
    return kvs


def _pool_block(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    rows = engine.prefix.match(ids)
    assert len(rows) == 1, "the prompt's whole block is in the prefix cache"
    return engine.prefix.pool[rows[0]]  # [layers, 2, kv heads, block, head dim]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_request_arriving_during_a_prefill_step_is_prefilled_before_that_steps_prompts_are_stored(tiny, device):
    order: list[str] = []

    async def run() -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
        args = {"max_seq_len": 128, "max_batch_size": 4, "kv_cache_config": {"tokens_per_block": BLOCK}}
        async with TorchEngine(tiny, DisaggregationMode.PREFILL, args, device=device) as engine:
            kvs = await _second_arrives_during_the_first(engine, order)
            for _ in range(100):  # the scheduler clock adds the store's time once it returned
                if engine.stats()["store_seconds_total"] > 0:
                    break
                await asyncio.sleep(0.01)
            return kvs, _pool_block(engine, FIRST), _pool_block(engine, SECOND), engine.stats()

    kvs, first_block, second_block, stats = asyncio.run(run())
    assert order == ["prefill first", "prefill second", "store 2"], order
    assert stats["store_seconds_total"] > 0
    # the scheduler clock's prefill phases, each counted, all of them within the admission's time
    phases = [stats[f"prefill_{part}_seconds_total"] for part in ("launch", "keep_kv", "pick", "answer")]
    assert min(phases) > 0 and sum(phases) + stats["store_seconds_total"] <= stats["admit_seconds_total"], stats
    # each prompt's block holds its own KV: the handed-over KV's first 32 positions
    torch.testing.assert_close(first_block, kvs["first"][:, :, :, :BLOCK], rtol=0, atol=0)
    torch.testing.assert_close(second_block, kvs["second"][:, :, :, :BLOCK], rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_slot_whose_prompt_is_not_stored_yet_is_stored_before_anything_is_prefilled_over_it(tiny, device):
    """One slot: the first prompt's slot is released with its answer, but the second prompt, already waiting, may
    only take it after the store has copied the first prompt's block out of it."""
    order: list[str] = []

    async def run() -> tuple[dict, torch.Tensor, torch.Tensor]:
        args = {"max_seq_len": 128, "max_batch_size": 1, "kv_cache_config": {"tokens_per_block": BLOCK}}
        async with TorchEngine(tiny, DisaggregationMode.PREFILL, args, device=device) as engine:
            kvs = await _second_arrives_during_the_first(engine, order)
            return kvs, _pool_block(engine, FIRST), _pool_block(engine, SECOND)

    kvs, first_block, second_block = asyncio.run(run())
    assert order == ["prefill first", "store 1", "prefill second", "store 1"], order
    torch.testing.assert_close(first_block, kvs["first"][:, :, :, :BLOCK], rtol=0, atol=0)
    torch.testing.assert_close(second_block, kvs["second"][:, :, :, :BLOCK], rtol=0, atol=0)
