"""The torch engine on a GPU: bf16, KV cache on the device, decode through the fused kernels."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hpc.runtime.engine import fused_decode  # noqa: E402
from hpc.runtime.engine.tiny import build_tiny  # noqa: E402
from hpc.runtime.engine.torch_engine import TorchEngine  # noqa: E402
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
    assert engine.model.fused_decode is not None
    assert engine.cache[0].device.type == "cuda" and engine.cache[0].dtype == torch.bfloat16
    assert all(len(t) == 12 for t in fused_tokens)
    monkeypatch.setattr(fused_decode, "available", lambda cfg, device: False)
    torch_tokens, plain = _run(model_dir)
    assert plain.model.fused_decode is None
    # bf16 rounds differently on the two paths, which can flip a greedy pick at a near-tie later on
    # (tests/runtime/test_fused_decode.py compares their logits against fp32); the start must agree
    assert [t[:6] for t in fused_tokens] == [t[:6] for t in torch_tokens]


def test_decode_steps_replay_from_cuda_graphs_with_the_eager_steps_tokens(tmp_path) -> None:
    model_dir = build_tiny(tmp_path / "tiny", hidden=256, layers=4)
    padded = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4]}}
    graphed, engine = _run(model_dir, padded)
    stats = engine.stats()
    assert ("graphs", 3) in engine.warmed and engine.cache[0].shape[1] == 4 + 1  # the spare slot for padded rows
    # every step ran from a graph, the three-row ones padded to four
    assert stats["decode_steps"] >= 11 and stats["decode_steps_graphed"] == stats["decode_steps"]
    eager, plain = _run(model_dir, {"cuda_graph_config": None})
    assert plain.graphs is None and plain.stats()["decode_steps"] >= 11 and "decode_steps_graphed" not in plain.stats()
    # the same kernels with the same inputs: rows are independent, so padding changes nothing
    assert graphed == eager
    unpadded, default = _run(model_dir)  # the key absent: on, one graph per size up to the engine's batch
    assert default.graphs.sizes.batch_sizes == (1, 2, 3, 4) and unpadded == eager
    assert default.stats()["decode_steps_graphed"] == default.stats()["decode_steps"]


def _run(model_dir, args: dict | None = None):
    return asyncio.run(_serve(model_dir, args))
