"""TensorRT-LLM's chunked prefill in the torch engine: a step's prompt tokens stay within max_num_tokens less a
token per decoding row; with enable_chunked_prefill a longer prompt is prefilled a chunk (a multiple of
tokens_per_block) per step while the decoding rows keep stepping between its chunks, and answers with the same
tokens as when prefilled whole."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hpc.engine_args.scheduling import ChunkingPolicy
from hpc.runtime.engine.torch.sequence import context_work
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from hpc.spec.recipe import TorchEngineSpec

pytestmark = pytest.mark.unit

FCFS, EQUAL = ChunkingPolicy.FIRST_COME_FIRST_SERVED, ChunkingPolicy.EQUAL_PROGRESS
# fp32 on a GPU too (the GPU suite runs this file): the same greedy tokens whichever way the prompt was split
BASE = {"max_seq_len": 256, "max_batch_size": 8, "kv_cache_config": {"tokens_per_block": 16}, "dtype": "float32"}
LONG = [(i * 37) % 900 + 10 for i in range(150)]  # 150 tokens
DECODING = [5, 6, 7, 8]


def _seq(tokens: int, done: int = 0, whole: bool = False) -> SimpleNamespace:
    """What context_work reads of a sequence: its prompt, the tokens in the cache, media or prompt logprobs."""
    sampling = SamplingParams(prompt_logprobs=1 if whole else None)
    return SimpleNamespace(request=SimpleNamespace(token_ids=[1] * tokens, sampling=sampling, media=None),
                           length=done)


def _sizes(work) -> list[int]:
    return [n for _, n in work]


def test_without_chunking_prompts_go_whole_and_the_first_that_does_not_fit_waits_with_those_behind_it():
    waiting = [_seq(30), _seq(40), _seq(5)]
    assert _sizes(context_work(waiting, 80, None, 16)) == [30, 40, 5]
    assert _sizes(context_work(waiting, 60, None, 16)) == [30]  # 40 does not fit; 5, behind it, waits too
    assert _sizes(context_work(waiting, 20, None, 16)) == []


def test_first_come_first_served_cuts_the_last_prompt_that_starts_to_a_multiple_of_the_unit():
    waiting = [_seq(30), _seq(100, done=16), _seq(5)]
    # 30 whole, then 84 left of the second: 33 of capacity left, cut to 32; the third gets 1 left, nothing
    assert _sizes(context_work(waiting, 63, FCFS, 16)) == [30, 32]
    assert _sizes(context_work(waiting, 200, FCFS, 16)) == [30, 84, 5]  # all fit: whole
    assert _sizes(context_work([_seq(100), _seq(5)], 12, FCFS, 16)) == [5]  # no unit fits the first; the next does
    # one that cannot be chunked goes whole or waits, with those behind it
    assert _sizes(context_work([_seq(30), _seq(50, whole=True), _seq(5)], 60, FCFS, 16)) == [30]


def test_equal_progress_gives_each_prompt_a_unit_in_turn():
    waiting = [_seq(100), _seq(20), _seq(100)]
    # rounds of 16: 16 + 16 + 16, then 16 + 4 + 16 (the second's end), then 16 more for the first
    assert _sizes(context_work(waiting, 100, EQUAL, 16)) == [48, 20, 32]


async def _timeline(model_dir, args: dict, mixed: bool = False) -> tuple[list[str], list[int], list[int], dict]:
    """A request decodes; at its first decode step LONG arrives. What the scheduler did, in order ('chunk N' for
    N prompt tokens of LONG, 'decode R' for a step of R rows, 'chunk N + decode R' for a mixed step), both
    answers and the engine's counters."""
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {**BASE, **args},
                           switches=TorchEngineSpec(mixed_steps=mixed)) as engine:
        loop = asyncio.get_running_loop()
        timeline: list[str] = []
        step, prefill, mixed_step = engine.decode._decode_step, engine.context._prefill, engine.mixed._step
        late: list[asyncio.Future] = []

        async def submit(ids):
            before = engine._inbox.qsize()
            task = asyncio.ensure_future(_collect(engine, ids, 6))
            while engine._inbox.qsize() == before:
                await asyncio.sleep(0.001)
            return task

        def stepped(running):
            timeline.append(f"decode {len(running)}")
            if not late:
                late.append(asyncio.run_coroutine_threadsafe(submit(LONG), loop).result())
            step(running)

        def recorded(group):
            timeline.extend(f"chunk {n}" for s, n in group if len(s.request.token_ids) == len(LONG))
            return prefill(group)
        def recorded_mixed(group, decoding):
            timeline.extend(f"chunk {n} + decode {len(decoding)}" for s, n in group
                            if len(s.request.token_ids) == len(LONG))
            return mixed_step(group, decoding)
        engine.decode._decode_step, engine.context._prefill, engine.mixed._step = stepped, recorded, recorded_mixed
        first = await _collect(engine, DECODING, 30)
        return timeline, first, await late[0], engine.stats()


async def _collect(engine: TorchEngine, ids: list[int], n: int) -> list[int]:
    request = GenerateRequest(request_id="r", token_ids=ids,
                              sampling=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [t async for out in engine.generate(request) for t in out.token_ids]


def test_a_long_prompt_is_prefilled_in_chunks_between_the_decode_steps_of_the_others_with_the_same_tokens(tiny):
    chunked, first, long_answer, stats = asyncio.run(_timeline(tiny, {"enable_chunked_prefill": True,
                                                                      "max_num_tokens": 64}))
    # 64 less the decoding row: 63, cut to 48 (3 blocks of 16) while 150 and 102 are left, then the last 54 whole
    assert [e for e in chunked if e.startswith("chunk")] == ["chunk 48"] * 2 + ["chunk 54"]
    start = chunked.index("chunk 48")
    # a decode step of the running request after every chunk: it never waits for the whole prompt
    assert chunked[start:start + 6] == ["chunk 48", "decode 1"] * 2 + ["chunk 54", "decode 2"]
    assert stats["prefill_chunks"] == 2
    whole, first_whole, long_whole, stats_whole = asyncio.run(_timeline(tiny, {}))
    assert [e for e in whole if e.startswith("chunk")] == ["chunk 150"] and "prefill_chunks" not in stats_whole
    assert long_answer == long_whole and first == first_whole and len(long_answer) == 6


def test_mixed_steps_carry_each_chunk_beside_the_decoding_row_with_the_same_tokens(tiny):
    mixed, first, long_answer, stats = asyncio.run(_timeline(tiny, {"enable_chunked_prefill": True,
                                                                    "max_num_tokens": 64}, mixed=True))
    start = mixed.index("chunk 48 + decode 1")
    # the chunks as apart, each in the decoding row's step; LONG decodes from the step after its last chunk
    assert mixed[start:start + 4] == ["chunk 48 + decode 1"] * 2 + ["chunk 54 + decode 1", "decode 2"]
    assert stats["mixed_steps"] == 3 and stats["prefill_chunks"] == 2
    _, first_apart, long_apart, _ = asyncio.run(_timeline(tiny, {"enable_chunked_prefill": True,
                                                                 "max_num_tokens": 64}))
    assert long_answer == long_apart and first == first_apart


def test_a_prompt_longer_than_max_num_tokens_is_refused_without_chunking_and_served_with_it(tiny):
    async def answer(args: dict, mode: DisaggregationMode = DisaggregationMode.AGGREGATED) -> list[int]:
        async with TorchEngine(tiny, mode, {**BASE, **args}) as engine:
            return await _collect(engine, LONG, 4)

    for mode in (DisaggregationMode.AGGREGATED, DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
        # a decode worker prefills a prompt that comes without a prefill worker's KV: refused too, not left
        # waiting forever for a step that could hold it
        with pytest.raises(ValueError, match=r"prompt \(150 tokens\) exceeds max_num_tokens \(64\); set "
                                             r"enable_chunked_prefill: true"):
            asyncio.run(answer({"max_num_tokens": 64}, mode))
    assert asyncio.run(answer({"max_num_tokens": 64, "enable_chunked_prefill": True})) == \
        asyncio.run(answer({}))
    for policy in ("EQUAL_PROGRESS", "FIRST_COME_FIRST_SERVED"):
        assert asyncio.run(answer({"max_num_tokens": 64, "enable_chunked_prefill": True,
                                   "scheduler_config": {"context_chunking_policy": policy}})) == \
            asyncio.run(answer({}))


def test_a_budget_below_one_chunk_is_refused_at_start(tiny):
    with pytest.raises(ValueError, match=r"max_num_tokens \(8\) is below one chunk"):
        TorchEngine(tiny, DisaggregationMode.AGGREGATED, {**BASE, "enable_chunked_prefill": True,
                                                          "max_num_tokens": 8})


def test_a_prefill_worker_hands_over_the_same_kv_after_a_chunked_prefill(tiny):
    async def handoff(args: dict):
        async with TorchEngine(tiny, DisaggregationMode.PREFILL, {**BASE, **args}) as engine:
            request = GenerateRequest(request_id="p", token_ids=LONG,
                                      sampling=SamplingParams(max_tokens=1, temperature=0))
            outs = [out async for out in engine.generate(request)]
            params = outs[-1].disaggregated_params
            return params.first_token_id, engine.handoffs.lend(params.request_handle).clone(), engine.stats()

    token, kv, stats = asyncio.run(handoff({"enable_chunked_prefill": True, "max_num_tokens": 64}))
    token_whole, kv_whole, _ = asyncio.run(handoff({}))
    assert stats["prefill_chunks"] == 2  # 64, 64, then the last 22
    assert token == token_whole and kv.shape == kv_whole.shape and kv.shape[3] == len(LONG)
    assert (kv - kv_whole).abs().max() < 1e-4
