"""Where a decode graph's device time goes, kernel by kernel, by batch size (needs CUDA):

    python benchmarks/decode_graph_kernels.py [--model tiny|llama-8b-shape] [--sizes 1,8,64] [--replays 50]

The engine's kept graph for each size (DecodeGraphs.kept) is replayed under torch's profiler; each kernel's device
time is summed by name and divided by the replays. The last line gives each size's replay as the device timed it
(decode_graphs.replay_seconds) beside the kernels' sum: the rest is the device's gaps between kernels. At c=64 the
tiny model's decode step waits on the device (167-193 µs a replay on an H200, against 71 at one row; session 21),
so this says which kernels grow with the rows. Its first run (session 22): at 64 rows the GEMVs took 81-124 µs
(39-44 at one row; their autotuned tiles are chosen once, whatever the rows), and the in-graph pick's two argmax
reductions 30 µs, now one of 15.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

from decode_graph_paths import parse_sizes  # noqa: E402
from e2e_throughput import device_label, direct_engine_args  # noqa: E402

from hpc.runtime.engine.torch.decode_graphs import replay_seconds  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode  # noqa: E402

NAME_WIDTH = 48


def short_name(name: str) -> str:
    """A kernel's name without 'void ', namespaces, template arguments and parameters, on one line."""
    name = re.sub(r"\s+", " ", name).strip()
    name = name.removeprefix("void ")
    opened, kept = [], []
    for ch in name:  # template arguments and parameter lists dropped, however deep ('->' inside them kept out)
        if ch in "<(":
            opened.append(ch)
        elif opened and ch == {"<": ">", "(": ")"}[opened[-1]]:
            opened.pop()
        elif not opened:
            kept.append(ch)
    base = "".join(kept).strip().split("::")[-1] or name
    return base[:NAME_WIDTH]


def per_replay(kernels: dict[str, tuple[float, int]], replays: int) -> dict[str, tuple[float, float]]:
    """{name: (µs a replay, launches a replay)} from {name: (µs in all, launches in all)}, names shortened (those
    that shorten alike summed)."""
    out: dict[str, tuple[float, float]] = {}
    for name, (micros, count) in kernels.items():
        key = short_name(name)
        had = out.get(key, (0.0, 0.0))
        out[key] = (had[0] + micros / replays, had[1] + count / replays)
    return out


def table(sizes: list[int], kernels: dict[int, dict[str, tuple[float, float]]],
          replay_us: dict[int, float]) -> list[str]:
    """Rows of kernels by their time at the largest size, µs a replay (launches) for each size; then the sums
    and each replay's device time."""
    top = sizes[-1]
    names = sorted({n for size in sizes for n in kernels[size]}, key=lambda n: -kernels[top].get(n, (0, 0))[0])
    lines = [f"{'kernel':<{NAME_WIDTH}}" + "".join(f"{f'{size} rows':>16}" for size in sizes)]
    for name in names:
        cells = [kernels[size].get(name) for size in sizes]
        lines.append(f"{name:<{NAME_WIDTH}}" + "".join(f"{f'{c[0]:.1f} ({c[1]:.0f})':>16}" if c else f"{'-':>16}"
                                                       for c in cells))
    lines.append(f"{'all kernels':<{NAME_WIDTH}}" + "".join(
        f"{sum(c[0] for c in kernels[size].values()):>16.1f}" for size in sizes))
    lines.append(f"{'a replay (device time)':<{NAME_WIDTH}}" + "".join(f"{replay_us[size]:>16.1f}" for size in sizes))
    return lines


def traced(replay, replays: int) -> dict[str, tuple[float, int]]:
    """{kernel name: (device µs, launches)} over `replays` replays, from the profiler's CUDA activity."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    out: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        micros = getattr(event, "self_device_time_total", None)
        if micros is None:
            micros = getattr(event, "self_cuda_time_total", 0)
        if micros > 0:
            out[event.key] = (micros, event.count)
    return out


async def measure(model: str, sizes: list[int], replays: int) -> tuple[str, list[int], dict, dict]:
    args = direct_engine_args(64, 64, 0, max(sizes), {})
    async with TorchEngine(ensure_model(f"~/.cache/hpc/models/{model}", model), DisaggregationMode.AGGREGATED,
                           args) as engine:
        graphs = engine.core.graphs
        if graphs is None:
            raise SystemExit("decode_graph_kernels.py: this engine captures no decode graphs (needs a CUDA GPU and "
                             "one rank)")
        kept = [size for size in sizes if size in graphs.sizes.batch_sizes]
        kernels, replay_us = {}, {}
        with engine.on_device():
            for size in kept:
                replay = graphs.kept(size)
                kernels[size] = per_replay(traced(replay, replays), replays)
                replay_us[size] = replay_seconds(replay, replays) * 1e6
        return device_label(engine), kept, kernels, replay_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sizes", default="1,8,64")
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    sizes = parse_sizes(args.sizes)
    if sizes is None or args.replays < 1:
        what = f"--sizes {args.sizes!r}" if sizes is None else f"--replays {args.replays}"
        print(f"decode_graph_kernels.py: {what}: give batch sizes as positive integers (e.g. 1,8,64) and a positive "
              "number of replays", file=sys.stderr)
        return 2
    label, kept, kernels, replay_us = asyncio.run(measure(args.model, sizes, args.replays))
    if not kept:
        print(f"decode_graph_kernels.py: no decode graph for any of {sizes}", file=sys.stderr)
        return 2
    print(f"a decode graph's kernels, µs of the device's time a replay (launches), {args.model} on {label}, "
          f"{args.replays} replays a size")
    print(*table(kept, kernels, replay_us), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
