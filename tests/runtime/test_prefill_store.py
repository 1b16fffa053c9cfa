"""A prefill worker stores its prompts into the prefix cache once nothing waits: a request that arrived during a
step is prefilled before the prompts of that step are stored, and a slot whose prompt is not stored yet is never
prefilled over before the store has copied it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hpc.runtime.engine.torch.engine import TorchEngine
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
    prefill, store = engine.context._prefill, engine.core.slots.store
    first_running, second_queued = threading.Event(), threading.Event()

    def traced_prefill(group):
        order.append("prefill " + ",".join(seq.request.request_id for seq, _ in group))
        if not first_running.is_set():
            first_running.set()
            assert second_queued.wait(10)  # the scheduler thread holds here until SECOND is in the inbox
        return prefill(group)

    engine.context._prefill = traced_prefill
    engine.core.slots.store = lambda prefix: (
        order.append(f"store {len(engine.core.slots.unstored)}"), store(prefix))[1]
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
        if not engine.core.slots.unstored:
            break
        await asyncio.sleep(0.01)
    return kvs


def _pool_block(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    rows = engine.core.prefix.match(ids)
    assert len(rows) == 1, "the prompt's whole block is in the prefix cache"
    return engine.core.prefix.pool[rows[0]]  # [layers, 2, kv heads, block, head dim]


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


class _Answers:
    """A request's outputs as the scheduler thread sends them (an engine process's LinkEmitter sends on that
    thread too): kept in order, `done` once the last came."""

    def __init__(self) -> None:
        self.outputs: list = []
        self.done = threading.Event()

    def put_nowait(self, out) -> None:
        self.outputs.append(out)
        if out.finished:
            self.done.set()


class _OnSchedulerThread:
    """The emitter of an engine process (engine_core.LinkEmitter): each output delivered on the scheduler thread."""

    def send(self, loop, outputs, out) -> None:
        outputs.put_nowait(out)

    def __enter__(self) -> "_OnSchedulerThread":
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_a_request_the_store_check_took_from_the_link_is_prefilled_without_waiting_for_the_link_again(tiny):
    """An engine process's scheduler reads its link itself (intake). When the store check finds a request there,
    that request is in the inbox, and the next look at the link must not wait for more (INTAKE_WAIT_S, 50 ms or
    the next message) while it sits there."""
    looks: list[tuple[float, int]] = []  # each look at the link: its wait, and requests already in the inbox
    order: list[str] = []
    link: list[GenerateRequest] = []  # requests that reached the link, not yet read by the scheduler
    answers = {"first": _Answers(), "second": _Answers()}
    woken = threading.Event()

    async def run() -> None:
        args = {"max_seq_len": 128, "max_batch_size": 4, "kv_cache_config": {"tokens_per_block": BLOCK}}
        async with TorchEngine(tiny, DisaggregationMode.PREFILL, args, device="cpu") as engine:
            engine.core.emitter = _OnSchedulerThread()
            prefill, store = engine.context._prefill, engine.core.slots.store

            def traced_prefill(group):
                order.append("prefill " + ",".join(seq.request.request_id for seq, _ in group))
                if group[0][0].request.request_id == "first":
                    link.append(_request("second", SECOND))  # arrives while the first is prefilled
                return prefill(group)

            def intake(wait: float) -> None:  # as engine_core.Core.intake: the link's requests into the inbox
                looks.append((wait, engine._inbox.qsize()))
                if not link and wait > 0:
                    woken.wait(wait)
                    woken.clear()
                while link:
                    request = link.pop(0)
                    engine.submit_now(request, answers[request.request_id])

            engine.context._prefill = traced_prefill
            engine.core.slots.store = lambda prefix: (
                order.append(f"store {len(engine.core.slots.unstored)}"), store(prefix))[1]
            engine.set_intake(intake, woken.set)
            link.append(_request("first", FIRST))
            woken.set()
            for name in ("first", "second"):
                assert await asyncio.to_thread(answers[name].done.wait, 10), name
                engine.release_handoff(answers[name].outputs[-1].disaggregated_params.request_handle)

    asyncio.run(run())
    assert order[:3] == ["prefill first", "prefill second", "store 2"], order
    assert any(wait == 0 and queued == 0 for wait, queued in looks)  # the store check looked at the link
    waited_with_work = [(wait, queued) for wait, queued in looks if wait > 0 and queued > 0]
    assert not waited_with_work, looks
