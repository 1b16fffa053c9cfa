"""Prompts that wait together are prefilled in one forward pass, right-padded, and answer exactly as when each
is prefilled alone — with a prefix reused from the cache on one row and not on the others."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from hpc.spec.recipe import TorchEngineSpec

pytestmark = pytest.mark.unit

SHARED = list(range(200, 240))  # 40 tokens: one full block of 32 for the prefix cache
FIRST = SHARED + [7, 8]
WAITING = [[5, 6, 7], SHARED + [9, 10, 11], [3] * 19, [42, 43, 44, 45, 46, 47, 48]]
# exact answers across batch shapes need fp32: on a GPU, bf16's rounding differs with the batch and flips a
# greedy pick now and then (one of 25 tokens on an H200)
ARGS = {"max_seq_len": 256, "max_batch_size": 8, "dtype": "float32"}
BLOCKS = {**ARGS, "kv_cache_config": {"tokens_per_block": 32}}


async def _tokens(engine: TorchEngine, ids: list[int]) -> list[int]:
    req = GenerateRequest(request_id="p", token_ids=ids, sampling=SamplingParams(max_tokens=5, temperature=0,
                                                                                  ignore_eos=True))
    return [t async for out in engine.generate(req) for t in out.token_ids]


async def _serve(model_dir, args: dict, mixed: bool = True) -> tuple[list[list[int]], dict, list[list[int]]]:
    """FIRST runs alone; while its first decode step is held, the others queue, then are admitted at once."""
    engine = TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {**BLOCKS, **args},
                         switches=TorchEngineSpec(mixed_steps=mixed))
    async with engine:
        entered, release = threading.Event(), threading.Event()
        step, widths = engine.decode._decode_step, []
        advance = engine.context.advance  # after each pass over prompt tokens, apart or mixed with decode rows

        def held(running):
            entered.set()
            release.wait(10)
            step(running)

        def recorded(group):
            widths.append([len(s.request.token_ids) for s, _ in group])
            return advance(group)
        engine.decode._decode_step, engine.context.advance = held, recorded
        first = asyncio.create_task(_tokens(engine, FIRST))
        await asyncio.to_thread(entered.wait, 10)
        waiting = [asyncio.create_task(_tokens(engine, ids)) for ids in WAITING]
        await asyncio.sleep(0.05)  # every request is in the engine's inbox
        release.set()
        answers = await asyncio.gather(first, *waiting)
        return answers, engine.stats(), widths


async def _one_by_one(model_dir) -> tuple[list[list[int]], dict]:
    """FIRST, then each waiting prompt, each sent when the one before has finished."""
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, BLOCKS) as engine:
        return [await _tokens(engine, ids) for ids in [FIRST] + WAITING], engine.stats()


def test_waiting_prompts_are_prefilled_together_with_the_answers_of_one_at_a_time(tiny):
    together, stats, widths = asyncio.run(_serve(tiny, {}))
    # FIRST alone, then the four waiting prompts in one forward pass, the fresh ones first (ContextSteps.prompt_parts)
    assert widths == [[len(FIRST)], [3, 19, 7, 43]]
    assert stats["prefill_steps"] == 2 and stats["requests"] == 5
    assert stats["prompt_tokens_cached"] == 32  # the row that shares FIRST's block took it from the cache
    alone, stats_alone = asyncio.run(_one_by_one(tiny))
    assert stats_alone["prefill_steps"] == 5 and stats_alone["prompt_tokens_cached"] == 32
    assert together == alone and all(len(t) == 5 for t in together)


def test_the_token_budget_splits_the_waiting_prompts(tiny):
    # padded to the widest row's computed tokens (the 43-token prompt computes 11, its first 32 come from the
    # prefix cache): 2 x 11 = 22 tokens fit in 44, a third row (3 x 19) does not; then 2 x 19
    _, stats, widths = asyncio.run(_serve(tiny, {"max_num_tokens": 44}, mixed=False))
    assert widths == [[len(FIRST)], [3, 43], [19, 7]]
    assert stats["prefill_steps"] == 3
    # a mixed step takes the step's whole work (40 tokens beside the decoding row), its parts unpadded apart
    _, stats, widths = asyncio.run(_serve(tiny, {"max_num_tokens": 44}))
    assert widths == [[len(FIRST)], [3, 19, 7, 43]] and stats["mixed_steps"] == 1


def test_a_prefill_worker_hands_over_each_prompt_of_a_step_with_its_own_kv(tiny):
    """Prompts prefilled in one step of a prefill worker are handed over together (one event for their copies
    on a GPU): each under its own handle, with the KV and first token it has when prefilled alone. Prompts of one
    length are kept by one gather, each its own contiguous part of one buffer."""
    prompts = [[5, 6, 7], SHARED + [9, 10, 11], [3] * 19, [4] * 19, [6] * 19]
    args = ARGS

    async def first_and_kv(engine, ids):
        req = GenerateRequest(request_id="p", token_ids=ids, sampling=SamplingParams(max_tokens=1, temperature=0))
        params = [out async for out in engine.generate(req)][-1].disaggregated_params
        kept = engine.handoffs.lend(params.request_handle)
        assert kept.is_contiguous()
        return params.request_handle, params.first_token_id, kept.clone(), kept.untyped_storage().data_ptr()

    async def together():
        engine = TorchEngine(tiny, DisaggregationMode.PREFILL, args)
        gate, get = threading.Event(), engine._inbox.get
        engine._inbox.get = lambda *a, **k: gate.wait(10) and get(*a, **k)  # the scheduler waits for all three
        async with engine:
            tasks = [asyncio.create_task(first_and_kv(engine, ids)) for ids in prompts]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(*tasks), engine.stats()

    async def alone():
        async with TorchEngine(tiny, DisaggregationMode.PREFILL, args) as engine:
            return [await first_and_kv(engine, ids) for ids in prompts]

    (handed, stats), single = asyncio.run(together()), asyncio.run(alone())
    assert stats["prefill_steps"] == 1 and len({handle for handle, *_ in handed}) == 5
    for (_, token, kv, _), (_, token_alone, kv_alone, _) in zip(handed, single):
        assert token == token_alone and kv.shape == kv_alone.shape and (kv - kv_alone).abs().max() < 1e-4
    buffers = [buffer for *_, buffer in handed]
    assert len(set(buffers[2:])) == 1 and len(set(buffers)) == 3  # the 19-token prompts' KVs: one buffer
