"""Requests that join an engine's decoding one after another: each starts once the one before has three tokens out."""

from __future__ import annotations

import asyncio
from typing import Callable

from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from hpc.spec.recipe import TorchEngineSpec


async def staggered(model_dir, args: dict, prompts: list[list[int]], max_tokens: Callable[[int], int],
                    switches: TorchEngineSpec | None = None) -> tuple[list[list[int]], dict]:
    """Each prompt's greedy tokens (`max_tokens(i)` for the i-th) and the engine's stats."""
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, args, switches=switches) as engine:
        started = [asyncio.Event() for _ in prompts]

        async def one(i: int) -> list[int]:
            if i:
                await started[i - 1].wait()  # after the one before has three tokens out
            sampling = SamplingParams(max_tokens=max_tokens(i), temperature=0, ignore_eos=True)
            tokens: list[int] = []
            try:
                async for out in engine.generate(GenerateRequest(request_id=str(i), token_ids=prompts[i],
                                                                 sampling=sampling)):
                    tokens += out.token_ids
                    if len(tokens) >= 3:
                        started[i].set()
            finally:
                started[i].set()  # a failed request must not hold the next one back for ever
            return tokens
        answers = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return answers, engine.stats()
