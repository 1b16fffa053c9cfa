"""The device's time for one decode-graph replay by batch size, on each path a step may take (needs CUDA):

    python benchmarks/decode_graph_paths.py [--model tiny|llama-8b-shape] [--sizes 1,4,8,16,32,64]

Past fused_decode.MAX_BATCH rows a decode step may run on the fused GEMVs or on cuBLAS matmuls around the same
Triton attention (fused_decode.PATHS). The engine captures both for each batch size at warm-up, times them and
keeps the one that replays faster (DecodeGraphs.capture); this prints those timings (and the kept graph's for the
sizes with one path), and which the engine kept. A size with no graph of its own is left out. For the tiny
model on an H200 the batched path cost 188-211 µs a step from 8 rows up, against 89-167 on the GEMVs
(docs/performance-log.md, session 21): the batched path is four times the launches, and a small model's weights stay in
L2 for every row the GEMVs read them for.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from e2e_throughput import device_label, direct_engine_args  # noqa: E402

from hpc.runtime.engine.kernels.fused_decode import MAX_BATCH, PATHS  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode  # noqa: E402


def parse_sizes(text: str) -> list[int] | None:
    """The batch sizes asked for, ascending; None if any is not a positive integer."""
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        return None
    return sizes if sizes[0] >= 1 else None


async def measure(model: str, sizes: list[int]) -> tuple[str, list[tuple[int, dict[str, float], str]]]:
    """Per size: each path's seconds a replay as the engine timed them at warm-up, or (one path, no choice)
    the kept graph's, timed here; and the path the engine kept. A size with no graph is left out."""
    args = direct_engine_args(64, 64, 0, max(sizes), {})
    async with TorchEngine(ensure_model(f"~/.cache/hpc/models/{model}", model), DisaggregationMode.AGGREGATED,
                           args) as engine:
        graphs = engine.core.graphs
        if graphs is None or engine.core.model.fused_decode is None:
            raise SystemExit("decode_graph_paths.py: this engine captures no decode graphs (needs a CUDA GPU, "
                             "Triton and one rank)")
        rows = []
        with engine.on_device():
            for size in sizes:
                if size not in graphs.sizes.batch_sizes:
                    continue
                only = engine.core.model.fused_decode.paths_for(size)[-1]
                seconds = graphs.timings.get(size) or {only: graphs.replay_seconds(size)}
                rows.append((size, seconds, graphs.paths.get(size, only)))
        return device_label(engine), rows


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
    label, rows = asyncio.run(measure(args.model, sizes))
    print(f"one decode-graph replay, µs of the device's time, {args.model} on {label} (past "
          f"{MAX_BATCH} rows both paths as the engine timed them at warm-up; else the kept graph, timed here)")
    print(f"{'rows':>5}  {'gemv':>8}  {'batched':>8}  the engine kept")
    for size, seconds, kept in rows:
        cells = [f"{seconds[name] * 1e6:8.1f}" if name in seconds else f"{'-':>8}" for name in PATHS]
        print(f"{size:>5}  {cells[0]}  {cells[1]}  {kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
