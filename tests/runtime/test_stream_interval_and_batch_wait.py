"""TensorRT-LLM's stream_interval (an output every N tokens, the first and the last always) and batch waiting
(prompts that arrive one by one while others decode wait to be prefilled together), in the torch engine: the
same tokens either way, only how they are sent and when prompts are admitted changes."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit

BASE = {"max_seq_len": 256, "max_batch_size": 8}


def _request(ids: list[int], n: int, logprobs: int | None = None) -> GenerateRequest:
    return GenerateRequest(request_id="r", token_ids=ids, sampling=SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs))


async def _outputs(model_dir, args: dict, n: int) -> list:
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {**BASE, **args}) as engine:
        return [out async for out in engine.generate(_request([5, 6, 7, 8], n, logprobs=1))]


def test_an_output_every_n_tokens_carries_the_same_tokens(tiny):
    every = asyncio.run(_outputs(tiny, {}, 10))
    fours = asyncio.run(_outputs(tiny, {"stream_interval": 4}, 10))
    assert [len(out.token_ids) for out in every] == [1] * 10
    # the first token at once, then at tokens 4 and 8, the rest with the last output
    assert [len(out.token_ids) for out in fours] == [1, 3, 4, 2]
    assert [t for out in fours for t in out.token_ids] == [t for out in every for t in out.token_ids]
    assert [lp.token_id for out in fours for lp in out.logprobs] == [t for out in fours for t in out.token_ids]
    assert fours[-1].finished and fours[-1].finish_reason == "length" and not any(o.finished for o in fours[:-1])


PROMPTS = [[11] * 12, [12] * 12, [13] * 12]


async def _arrivals(model_dir, args: dict) -> tuple[list[list[int]], list[list[int]], dict]:
    """A long request decodes; during its first three decode steps one more prompt arrives at each."""
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {**BASE, **args}) as engine:
        loop = asyncio.get_running_loop()
        widths: list[list[int]] = []
        step, advance = engine.decode._decode_step, engine.context.advance  # after a pass, apart or mixed
        late: list[asyncio.Future] = []

        async def submit(ids):  # in the engine's inbox when this returns (the scheduler waits for it meanwhile)
            before = engine._inbox.qsize()
            task = asyncio.ensure_future(_collect(engine, ids))
            while engine._inbox.qsize() == before:
                await asyncio.sleep(0.001)
            return task

        def stepped(running):
            if len(late) < len(PROMPTS):
                late.append(asyncio.run_coroutine_threadsafe(submit(PROMPTS[len(late)]), loop).result())
            step(running)

        def recorded(group):
            widths.append([len(s.request.token_ids) for s, _ in group])
            return advance(group)
        engine.decode._decode_step, engine.context.advance = stepped, recorded
        await _collect(engine, [9] * 20, n=40)
        answers = await asyncio.gather(*late)
        return widths, answers, engine.stats()


async def _collect(engine: TorchEngine, ids: list[int], n: int = 6) -> list[int]:
    return [t async for out in engine.generate(_request(ids, n)) for t in out.token_ids]


def test_prompts_arriving_one_by_one_wait_to_be_prefilled_together(tiny):
    widths, answers, stats = asyncio.run(_arrivals(tiny, {}))
    assert widths == [[20], [12], [12], [12]]  # without waiting: a prefill step each
    # up to 100 steps, or until the prompts and the decoding row make half of 64 tokens: 12 + 12 + 12 + 1 >= 32
    waited, waited_answers, waited_stats = asyncio.run(_arrivals(tiny, {
        "batch_wait_timeout_iters": 100, "batch_wait_max_tokens_ratio": 0.5, "max_num_tokens": 64}))
    assert waited == [[20], [12, 12, 12]]
    assert waited_answers == answers and all(len(a) == 6 for a in answers)
    assert waited_stats["prefill_steps"] == 2 and waited_stats["waiting"] == 0 and stats["prefill_steps"] == 4
    # or for 2 steps when the tokens never reach the ratio: the first prompt waited two, the others came meanwhile
    never = {"batch_wait_max_tokens_ratio": 1.0, "max_num_tokens": 64}
    timed, _, _ = asyncio.run(_arrivals(tiny, {"batch_wait_timeout_iters": 2, **never}))
    assert timed == [[20], [12, 12, 12]]
    once, _, _ = asyncio.run(_arrivals(tiny, {"batch_wait_timeout_iters": 1, **never}))
    assert once == [[20], [12, 12], [12]]
    # TensorRT-LLM's rule: a ratio of 0 is reached at once, so the steps alone hold nothing back
    alone, _, _ = asyncio.run(_arrivals(tiny, {"batch_wait_timeout_iters": 2}))
    assert alone == [[20], [12], [12], [12]]
