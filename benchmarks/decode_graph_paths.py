"""The device's time for one decode-graph replay by batch size, on each path a step may take (needs CUDA):

    python benchmarks/decode_graph_paths.py [--model tiny|llama-8b-shape] [--sizes 1,4,8,16,32,64]

Past fused_decode.MAX_BATCH rows a decode step may run on the fused GEMVs or on cuBLAS matmuls around the same
Triton attention (fused_decode.PATHS). The engine captures both for each batch size at warm-up and keeps the one
that replays faster (DecodeGraphs.capture); this prints what each takes, and which the engine kept. For the tiny
model on an H200 the batched path cost 188-211 µs a step from 8 rows up, against 89-167 on the GEMVs
(docs/performance.md, session 21): the batched path is four times the launches, and a small model's weights stay in
L2 for every row the GEMVs read them for.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from e2e_throughput import device_label, direct_engine_args  # noqa: E402

from hpc.runtime.engine.decode_graphs import cuda_capture, replay_seconds  # noqa: E402
from hpc.runtime.engine.tiny import ensure_model  # noqa: E402
from hpc.runtime.engine.torch_engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode  # noqa: E402


def parse_sizes(text: str) -> list[int] | None:
    """The batch sizes asked for, ascending; None if any is not a positive integer."""
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        return None
    return sizes if sizes[0] >= 1 else None


async def measure(model: str, sizes: list[int]) -> tuple[str, dict[int, str], list[tuple[int, dict[str, float]]]]:
    import torch

    args = direct_engine_args(64, 64, 0, max(sizes), {})
    async with TorchEngine(ensure_model(f"~/.cache/hpc/models/{model}", model), DisaggregationMode.AGGREGATED,
                           args) as engine:
        if engine.graphs is None or engine.model.fused_decode is None:
            raise SystemExit("decode_graph_paths.py: this engine captures no decode graphs (needs a CUDA GPU, "
                             "Triton and one rank)")
        fused, graphs = engine.model.fused_decode, engine.graphs
        capture = cuda_capture(engine.device)
        rows, alive = [], []
        with engine.on_device(), torch.inference_mode():
            for size in sizes:
                timed = {}
                for name in fused.paths_for(size):
                    with fused.path(name):  # a graph of its own, beside the engine's (which stay as captured)
                        replay, _ = capture(graphs._step_of(size, 0 if graphs.copies_in_graph else None))
                    timed[name] = replay_seconds(replay, times=100)
                    # kept to the end: the last graph of a pool gone, the allocator frees the pool, and the next
                    # capture into it fails an internal assert (torch 2.11, CUDACachingAllocator.cpp:2799)
                    alive.append(replay)
                rows.append((size, timed))
        return device_label(engine), dict(graphs.paths), rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    args = parser.parse_args()
    sizes = parse_sizes(args.sizes)
    if sizes is None:
        print(f"decode_graph_paths.py: --sizes {args.sizes!r}: give batch sizes as positive integers, e.g. 1,8,64",
              file=sys.stderr)
        return 2
    label, kept, rows = asyncio.run(measure(args.model, sizes))
    print(f"one decode-graph replay, µs of the device's time (100 back to back), {args.model} on {label}")
    print(f"{'rows':>5}  {'gemv':>8}  {'batched':>8}  the engine kept")
    for size, timed in rows:
        cells = [f"{timed[name] * 1e6:8.1f}" if name in timed else f"{'-':>8}" for name in ("gemv", "batched")]
        print(f"{size:>5}  {cells[0]}  {cells[1]}  {kept.get(size, 'gemv' if 'gemv' in timed else 'batched')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
