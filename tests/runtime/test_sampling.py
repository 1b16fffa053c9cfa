"""What the torch engine's sampler reports: logprobs of the model's own distribution, penalties or not."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.torch_engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit


def test_penalised_greedy_picks_are_reported_with_the_models_logprobs(tiny):
    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256}) as engine:
            sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1,
                                      presence_penalty=2.0, frequency_penalty=2.0)
            req = GenerateRequest(request_id="r", token_ids=[5, 6, 7], sampling=sampling)
            return [lp for out in [o async for o in engine.generate(req)] for lp in out.logprobs or []]

    logprobs = asyncio.run(main())
    assert len(logprobs) == 24
    # greedy on penalised logits: the pick is the top of the penalised distribution, but what is reported is the
    # model's own, where a penalised token's best rival ranks higher — so the pick is not always the raw top-1
    assert any(lp.logprob < lp.top_logprobs[0] for lp in logprobs)
    assert logprobs[0].logprob == pytest.approx(logprobs[0].top_logprobs[0])  # no penalty before the first token
