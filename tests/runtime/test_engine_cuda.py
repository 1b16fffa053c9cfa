"""The torch engine on a GPU: bf16, KV cache on the device, decode through the fused kernels."""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch

# the tests count steps and replays as tokens: one step a replay
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_step_a_replay")]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hpc.runtime.engine.kernels import fused_decode  # noqa: E402
from hpc.runtime.engine.models.tiny import build_tiny  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 300, 41, 9], [7, 7, 1200], [99, 3, 3, 3, 250, 11, 64]]


async def _serve(model_dir, args: dict | None = None) -> tuple[list[list[int]], TorchEngine]:
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {"max_batch_size": 4, **(args or {})}) as engine:
        async def one(i: int, prompt: list[int]) -> list[int]:
            request = GenerateRequest(request_id=f"r{i}", token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=12, ignore_eos=True))
            return [t async for out in engine.generate(request) for t in out.token_ids]

        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))  # batched decode steps
    return list(tokens), engine


def test_engine_runs_bf16_on_the_gpu_through_the_fused_kernels(tmp_path, monkeypatch) -> None:
    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)
    fused_tokens, engine = _run(model_dir)
    assert engine.core.model.fused_decode is not None
    assert engine.core.cache[0].device.type == "cuda" and engine.core.cache[0].dtype == torch.bfloat16
    assert all(len(t) == 12 for t in fused_tokens)
    monkeypatch.setattr(fused_decode, "available", lambda cfg, device: False)
    torch_tokens, plain = _run(model_dir)
    assert plain.core.model.fused_decode is None
    # bf16 rounds differently on the two paths, which can flip a greedy pick at a near-tie later on
    # (tests/runtime/test_fused_decode.py compares their logits against fp32); the start must agree
    assert [t[:6] for t in fused_tokens] == [t[:6] for t in torch_tokens]


def test_decode_steps_replay_from_cuda_graphs_with_the_eager_steps_tokens(tmp_path) -> None:
    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)
    padded = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4]}}
    graphed, engine = _run(model_dir, padded)
    stats = engine.stats()
    assert ("graphs", 3) in engine.warmed and engine.core.cache[0].shape[1] == 4 + 1  # the spare slot for padded rows
    # every step ran from a graph, the three-row ones padded to four
    assert stats["decode_steps"] >= 11 and stats["decode_steps_graphed"] == stats["decode_steps"]
    # the overlapped steps' greedy tokens were picked inside the graphs (and equal the eager argmax, below)
    assert stats["decode_steps_picked_in_graph"] == stats["decode_steps_overlapped"] > 0
    # and once no row joined with its first token on the device, the rows going on took their tokens from the
    # step before inside the graph (DecodeGraphs.picks), with the eager tokens all the same
    assert stats["decode_steps_carried_in_graph"] >= 6, stats
    eager, plain = _run(model_dir, {"cuda_graph_config": None})
    assert plain.core.graphs is None and plain.stats()["decode_steps"] >= 11 and "decode_steps_graphed" not in plain.stats()
    # the same kernels with the same inputs: rows are independent, so padding changes nothing
    assert graphed == eager
    unpadded, default = _run(model_dir)  # the key absent: on, one graph per size up to the engine's batch
    assert default.core.graphs.sizes.batch_sizes == (1, 2, 3, 4) and unpadded == eager
    assert default.stats()["decode_steps_graphed"] == default.stats()["decode_steps"]

    async def prefill_only():
        async with TorchEngine(model_dir, DisaggregationMode.PREFILL, {"max_batch_size": 4}) as engine:
            return engine.core.graphs, engine.warmed
    graphs, warmed = asyncio.run(prefill_only())
    assert graphs is None and ("graphs", 4) not in warmed  # a prefill worker never decodes: nothing captured


def test_decode_graphs_that_make_their_own_copies_give_the_eager_tokens(tmp_path, monkeypatch) -> None:
    """By default each step's input and output copies are captured in its graph (torch_engine.decode_graph_copies
    false: the host launches them); either way the overlapped, graphed steps give the eager steps' tokens."""
    from hpc.runtime.engine.torch import engine as engine_module
    from hpc.spec.recipe import TorchEngineSpec

    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)
    eager, _ = _run(model_dir, {"cuda_graph_config": None})
    graphs = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4]}}
    for in_graph in (True, False):
        switches = TorchEngineSpec(decode_steps_per_graph=1, decode_graph_copies=in_graph)
        monkeypatch.setattr(engine_module, "DEFAULT_SWITCHES", switches)
        graphed, engine = _run(model_dir, graphs)
        stats = engine.stats()
        assert engine.core.graphs.copies_in_graph is in_graph
        assert stats["decode_steps_graphed"] == stats["decode_steps"] >= 11
        assert stats["decode_steps_carried_in_graph"] >= 6, stats
        assert graphed == eager


def test_prefills_replay_from_cuda_graphs_with_the_eager_prefills_tokens(tmp_path) -> None:
    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)
    # fp32: the packed graph's masked attention and the eager causal one round alike, so greedy tokens must agree
    fp32 = {"dtype": "float32"}
    graphed, engine = _run(model_dir, {**fp32, "torch_compile_config": {"enable_piecewise_cuda_graph": True,
                                                                        "capture_num_tokens": [4, 8, 16]}})
    stats = engine.stats()
    assert ("prefill graphs", 3) in engine.warmed and engine.core.cache[0].shape[1] == 4 + 1  # the spare slot
    # three prompts of 5, 3 and 7 tokens, prefilled together (15 -> 16) or apart: every one from a graph
    assert stats["prefill_steps"] >= 1 and stats["prefill_steps_graphed"] == stats["prefill_steps"]
    eager, plain = _run(model_dir, {**fp32, "torch_compile_config": None})
    assert plain.core.prefill_graphs is None and "prefill_steps_graphed" not in plain.stats()
    assert graphed == eager

    async def decode_only():
        args = {"torch_compile_config": {"enable_piecewise_cuda_graph": True}}
        async with TorchEngine(model_dir, DisaggregationMode.DECODE, {"max_batch_size": 4, **args}) as engine:
            return engine.core.prefill_graphs
    assert asyncio.run(decode_only()) is None  # a decode worker takes its KV from a prefill worker


def test_a_prefill_reads_the_device_once_per_step_not_in_every_layer(tmp_path) -> None:
    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)

    async def main() -> list[int]:
        async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {"max_batch_size": 4}) as engine:
            model, device, counts = engine.core.model, engine.device, []
            ids = torch.arange(2, 34, device=device)
            # one prompt from scratch (causal), one after a cached prefix and two right-padded rows (masked)
            for positions, slots in ((torch.arange(32)[None], [0]), (torch.arange(8, 40)[None], [1]),
                                     (torch.arange(32).repeat(2, 1), [2, 3])):
                embeds = model.embed(ids.repeat(len(slots), 1))
                positions, slots = positions.to(device), torch.tensor(slots, device=device)
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        model.forward_step(embeds, positions, slots, engine.core.cache,
                                           last=torch.tensor([31, 20], device=device) if len(slots) > 1 else None)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                counts.append(sum("synchroniz" in str(w.message) for w in caught))
            return counts

    # a read or two per step (is it a prompt from scratch? the longest row; SDPA's own), never one per layer
    # (four here: a sync per layer and row made a 64-token prefill of the tiny model 3 ms)
    counts = asyncio.run(main())
    assert len(counts) == 3 and max(counts) <= 2


def test_sampled_rows_are_drawn_inside_the_decode_graphs_with_fresh_noise_each_step(tmp_path) -> None:
    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)

    async def main():
        async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {"max_batch_size": 4}) as engine:
            async def one(i: int) -> list[int]:
                request = GenerateRequest(request_id=f"s{i}", token_ids=PROMPTS[0], sampling=SamplingParams(
                    max_tokens=24, temperature=100.0, ignore_eos=True))
                return [t async for out in engine.generate(request) for t in out.token_ids]
            return await asyncio.gather(*(one(i) for i in range(3))), engine.stats()

    answers, stats = asyncio.run(main())
    assert stats["decode_steps_picked_in_graph"] >= 20, stats
    # near-uniform draws: a replay that reused the noise of the one before would pick one token over and over
    assert all(len(set(tokens)) > 12 for tokens in answers) and len({tuple(t) for t in answers}) == 3


def test_the_scheduler_thread_makes_its_pinned_buffers_before_the_engine_serves(tmp_path) -> None:
    from hpc.runtime.engine.torch.sampling import _PinnedRing

    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)

    async def main() -> list[str]:
        before = len(_PinnedRing.made_by)
        async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {"max_batch_size": 2}):
            return _PinnedRing.made_by[before:]

    assert "torch-engine" in asyncio.run(main())  # as it started, not in the first request


def _run(model_dir, args: dict | None = None):
    return asyncio.run(_serve(model_dir, args))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_engine_on_the_second_gpu_runs_its_triton_kernels_there(tmp_path) -> None:
    # The local disaggregated launch puts decode on cuda:1. Triton launches on the thread's current device
    # (cuda:0 unless set), so the fused kernels' autotuning failed with "Pointer argument cannot be accessed
    # from Triton" before the engine made its GPU current in the threads that load it and schedule.
    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)

    async def main():
        async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {"max_batch_size": 4},
                               device="cuda:1") as engine:
            req = GenerateRequest(request_id="g1", token_ids=PROMPTS[0],
                                  sampling=SamplingParams(max_tokens=8, ignore_eos=True))
            return [t async for out in engine.generate(req) for t in out.token_ids], engine
    tokens, engine = asyncio.run(main())
    assert len(tokens) == 8 and engine.core.cache[0].device == torch.device("cuda:1")
    assert engine.core.model.fused_decode is not None and engine.stats()["decode_steps_graphed"] >= 7


def test_random_weights_leave_no_cached_blocks_a_worker_sharing_the_gpu_could_use(tmp_path) -> None:
    """A generated model's weights are drawn in place in bf16: an fp32 draw cast afterwards left its freed block
    pinned by the bf16 half that reused it (8.5 GiB for an 8B shape's worker, session 38)."""
    from hpc.runtime.engine.models.tiny import LLAMA_8B_SHAPE, build_shaped

    shape = {**LLAMA_8B_SHAPE, "num_hidden_layers": 2, "intermediate_size": 4096}  # 128,256 x 4,096 embeddings
    model_dir = build_shaped(tmp_path / "m", shape, seed=1)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()

    async def load() -> float:
        # no graphs: their pools are reserved memory of their own, beside what this test is about
        args = {"dtype": "bfloat16", "max_seq_len": 256, "max_batch_size": 2, "cuda_graph_config": None,
                "torch_compile_config": None}
        async with TorchEngine(model_dir, DisaggregationMode.PREFILL, args) as engine:
            assert engine.core.model.model.embed_tokens.weight.dtype == torch.bfloat16
            return (torch.cuda.memory_reserved() - torch.cuda.memory_allocated() - before) / 2**30

    cached = asyncio.run(load())
    assert cached < 0.5, f"{cached:.2f} GiB reserved beyond what the engine holds"  # the fp32 way: 2 x 0.98
