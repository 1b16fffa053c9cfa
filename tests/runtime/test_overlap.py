"""The overlap scheduler (TensorRT-LLM's, on unless disable_overlap_scheduler): a decode step launched from the
previous step's tokens while they are still on the device gives exactly the step-by-step answers — with requests
ending at different steps, by count, by a stop token read after the next step was launched, and at the cache's
length — and steps aside for rows that need their tokens on the host."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.torch_engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit

MAX_LEN = 64
PROMPTS = [[5, 6, 7, 8], [40, 41], [9] * 12, [100, 200, 300]]


async def _answers(model_dir, args: dict, requests: list[SamplingParams]) -> tuple[list[tuple], dict]:
    engine_args = {"max_seq_len": MAX_LEN, "max_batch_size": 8, **args}
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, engine_args) as engine:
        async def one(ids, sampling):
            outs = [out async for out in engine.generate(GenerateRequest(request_id="r", token_ids=ids,
                                                                         sampling=sampling))]
            return [t for out in outs for t in out.token_ids], outs[-1].finish_reason
        answers = await asyncio.gather(*(one(ids, p) for ids, p in zip(PROMPTS, requests)))
        return answers, engine.stats()


def _both(tiny, requests):
    overlapped, stats = asyncio.run(_answers(tiny, {}, requests))
    stepwise, plain = asyncio.run(_answers(tiny, {"disable_overlap_scheduler": True}, requests))
    assert plain.get("decode_steps_overlapped", 0) == 0
    return overlapped, stepwise, stats


def test_overlapped_steps_answer_as_step_by_step_ones(tiny):
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 3, 14, 1)]
    reference, _ = asyncio.run(_answers(tiny, {"disable_overlap_scheduler": True}, free))
    # a stop token the first request meets at its 5th token: read after the next step was already launched
    stop = reference[0][0][4]
    requests = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, stop_token_ids=[stop]), *free[1:]]
    # and one whose last token takes the cache's last position (12 + 51 = 63 of 64)
    requests[2] = SamplingParams(max_tokens=MAX_LEN - 12 - 1, temperature=0, ignore_eos=True)
    overlapped, stepwise, stats = _both(tiny, requests)
    assert overlapped == stepwise
    first_stop = reference[0][0].index(stop)
    assert overlapped[0] == (reference[0][0][:first_stop + 1], "stop")
    assert [len(tokens) for tokens, _ in overlapped[1:]] == [3, MAX_LEN - 12 - 1, 1]
    assert stats["decode_steps_overlapped"] > 0, stats  # the overlapped path ran
    assert stats["decode_steps_overlapped"] < stats["decode_steps"]  # and stepped aside at the ends


def test_rows_that_need_their_tokens_on_the_host_step_by_step(tiny):
    greedy = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for _ in PROMPTS]
    with_logprobs = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2), *greedy[1:]]
    overlapped, stepwise, stats = _both(tiny, with_logprobs)
    assert overlapped == stepwise
    assert stats.get("decode_steps_overlapped", 0) == 0  # one row with logprobs keeps the whole batch step-wise
    sampled = [SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True) for _ in PROMPTS]
    answers, stats = asyncio.run(_answers(tiny, {}, sampled))
    assert [len(tokens) for tokens, _ in answers] == [7] * 4 and stats["decode_steps_overlapped"] > 0


def test_greedy_and_sampled_rows_in_one_overlapped_batch(tiny):
    mixed = [SamplingParams(max_tokens=8, temperature=t, ignore_eos=True) for t in (0, 1.0, 0, 0.7)]
    overlapped, stepwise, stats = _both(tiny, mixed)
    assert [overlapped[i] for i in (0, 2)] == [stepwise[i] for i in (0, 2)]  # the greedy rows, exactly
    assert [len(tokens) for tokens, _ in overlapped] == [8] * 4 and stats["decode_steps_overlapped"] > 0
