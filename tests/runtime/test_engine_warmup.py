"""The torch engine runs every kind of step it will serve before it says ready."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.kernels import fused_decode
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit


def test_warm_up_covers_prefill_and_every_decode_path_before_the_first_request(tiny, monkeypatch):
    from hpc.runtime.engine.torch import engine as engine_module, warmup

    steps = []
    sampled = []  # (rows, top_k) of each sampling kernel run: their modules load before the first request
    real_sample_rows = warmup.sample_rows
    monkeypatch.setattr(warmup, "sample_rows", lambda logits, params, gen: (
        sampled.append((logits.shape[0], params[0].top_k)), real_sample_rows(logits, params, gen))[1])

    async def main():
        engine = TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256, "max_batch_size": 8})

        def counted(core):
            forward = core.model.forward_step

            def record(embeds, positions, slots, cache, **kw):
                steps.append(tuple(embeds.shape[:2]))
                return forward(embeds, positions, slots, cache, **kw)
            core.model.forward_step = record
            try:
                return warmup.warm_up(core)
            finally:
                core.model.forward_step = forward
        monkeypatch.setattr(engine_module, "warm_up", counted)
        async with engine:
            assert steps, "warm-up ran inside load(), before the engine was handed out"
            warmed = list(steps)
            assert sampled == [(1, 0), (1, 40), (2, 0), (2, 40)]  # plain and top-k/top-p, on 1 and 2 rows
            req = GenerateRequest(request_id="r", token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3))
            outs = [o async for o in engine.generate(req)]
            assert sum(len(o.token_ids) for o in outs) == 3
            return warmed, engine.warmed, engine.warmup_s, engine.core.graphs

    warmed, reported, seconds, graphs = asyncio.run(main())
    # a 16-token prompt, then one-token steps at 1 row, past the fused GEMVs' batch limit, and the full batch
    # a prompt alone (causal) and two together (masked), then decode at 1, 2 (Triton's other integer
    # specialization), the first batched-matmul size and the largest batch
    assert warmed[:6] == [(1, 16), (2, 16), (1, 1), (2, 1), (fused_decode.MAX_BATCH + 1, 1), (8, 1)]
    assert reported[:5] == [("prefill", 16), ("decode", 1), ("decode", 2), ("decode", fused_decode.MAX_BATCH + 1),
                            ("decode", 8)]
    # on a GPU, then every decode graph (cuda_graph_config absent: one per size up to the batch), largest first,
    # an eager run and the capture each: one per staging buffer, and one more per path where a size had two to
    # time; then, where the host bounds a step, the graphs of several steps a replay (a forward each step)
    sizes = [] if graphs is None else sorted(graphs.sizes.batch_sizes, reverse=True)
    paths = {size: len(graphs.timings[size]) if size in graphs.timings else 1 for size in sizes}
    one_step = [(size, 1) for size in sizes for _ in range(2 * (paths[size] + 1))]
    several = [(size, 1) for size in sizes for _ in range(2 * 2 * graphs.steps)] if sizes and graphs.steps > 1 else []
    assert warmed[6:] == one_step + several
    assert reported[5:] == [("sampling", 2)] + ([("graphs", 8)] if graphs is not None else [])
    assert seconds > 0


def test_the_engine_counts_each_requests_wait_for_a_slot_and_for_its_first_token(tiny):
    # what stack_sweeps prints per worker: where a request's time to first token goes inside the engine
    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256, "max_batch_size": 1}) as engine:
            requests = [GenerateRequest(request_id=f"r{i}", token_ids=[5, 6, 7],
                                        sampling=SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(2)]

            async def run(req):
                return [o async for o in engine.generate(req)]
            await asyncio.gather(*(run(r) for r in requests))
            return engine.stats()

    stats = asyncio.run(main())
    assert stats["requests"] == 2 and stats["first_tokens"] == 2
    # one slot: the second request waited for the first to finish its 8 tokens before it had a slot
    assert 0 < stats["queue_seconds_total"] < stats["first_token_seconds_total"]
