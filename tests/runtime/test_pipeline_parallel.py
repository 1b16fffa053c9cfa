"""Pipeline parallelism in the torch engine: two gloo ranks, each a stage of the tiny model's layers, give the
same greedy tokens as one rank (fp32 on CPU)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import torch
import torch.distributed as dist

from hpc.runtime.engine.llama import TensorParallel
from hpc.runtime.engine.torch_engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit

ARGS = {"max_seq_len": 128, "max_batch_size": 4}
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 9]


async def _greedy(engine: TorchEngine) -> list[list[int]]:
    async def one(ids: list[int]) -> list[int]:
        req = GenerateRequest(request_id="r", token_ids=ids,
                              sampling=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        return [t async for out in engine.generate(req) for t in out.token_ids]
    return list(await asyncio.gather(*[one(p) for p in PROMPTS]))  # batched decode steps across the stages


def _stage(rank: int, port: int, model_dir: str, out: str) -> None:
    from hpc.runtime.engine.tp import broadcast_stop, follow

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        world = TensorParallel(rank, 2, dist.group.WORLD)
        engine = TorchEngine(model_dir, DisaggregationMode.AGGREGATED, ARGS, tp=world, pipeline=True, device="cpu")
        if rank == 0:
            async def main() -> list[list[int]]:
                async with engine:
                    tokens = await _greedy(engine)
                broadcast_stop(world, engine.device)
                return tokens
            tokens = asyncio.run(main())
            layers = [len(engine.model.model.layers), engine.cfg.num_hidden_layers]
            with open(out, "w") as handle:
                json.dump({"tokens": tokens, "layers": layers}, handle)
        else:
            engine.load()
            assert len(engine.model.model.layers) < engine.cfg.num_hidden_layers  # only its own stage
            follow(engine)
    finally:
        dist.destroy_process_group()


def test_two_pipeline_stages_give_the_single_rank_tokens(model_cache, tmp_path):
    from hpc.runtime.engine.tiny import ensure_model

    model_dir = str(ensure_model(str(model_cache / "tiny"), "tiny"))

    async def single() -> list[list[int]]:
        async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, ARGS, device="cpu") as engine:
            return await _greedy(engine)
    want = asyncio.run(single())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "pp.json"
    torch.multiprocessing.spawn(_stage, args=(port, model_dir, str(out)), nprocs=2)
    got = json.loads(out.read_text())
    stage_layers, total = got["layers"]
    assert 0 < stage_layers < total  # rank 0 held half the layers, not the model
    assert got["tokens"] == want and all(len(t) == 8 for t in want)
