"""Where a batched decode step of the torch engine goes, on one GPU (issue #63's decode goal; needs CUDA):

    python benchmarks/decode_profile.py [--model llama-8b-shape] [--batch 64] [--prompt 512] [--steps 128] [--ungrouped]

Runs reference_engine.py's decode round (every request decoding, fresh prompts) once unprofiled for its tokens/s
and the engine's step counters, then once under torch.profiler, and prints: the wall time of a decode step, the
GPU's kernel time in it (busy share), the top kernels by GPU time, and the top host operations by CPU time. A step
that is far from the memory bound with the GPU mostly idle is the host's; with the GPU busy, the kernels'.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_engine import TORCH_ENGINE_DEFAULTS, _decode_round, decode_bound, deep_update  # noqa: E402

from gpu_check import copy_bandwidth  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode  # noqa: E402


async def measure(model_dir, args) -> None:
    engine_args = deep_update(TORCH_ENGINE_DEFAULTS, {"dtype": "bfloat16", "max_seq_len": 2048,
                                                      "max_batch_size": max(64, args.batch)})
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, engine_args) as engine:
        await _decode_round(engine, args.batch, args.prompt, 16)  # warm
        before = dict(engine.stats())
        tok_s = await _decode_round(engine, args.batch, args.prompt, args.steps)
        after = dict(engine.stats())
        steps = {k: after.get(k, 0) - before.get(k, 0) for k in after
                 if k.startswith("decode") and isinstance(after.get(k), (int, float))}
        bound = decode_bound(engine, copy_bandwidth(torch.device("cuda"), best_of=3), args.batch,
                             args.prompt + args.steps // 2)
        print(f"batch {args.batch}: {tok_s:.0f} tok/s, {tok_s / bound:.0%} of the memory bound {bound:.0f}; "
              f"decode counters over the round: {steps}")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            profiled_tok_s = await _decode_round(engine, args.batch, args.prompt, args.steps)
        n = max(steps.get("decode_steps", args.steps), 1)
        events = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in events) / n / 1e3
        step_ms = 1e3 * args.batch / max(profiled_tok_s, 1e-9)
        print(f"profiled: {profiled_tok_s:.0f} tok/s, a step {step_ms:.2f} ms wall, its kernels {gpu_ms:.2f} ms "
              f"(GPU busy {gpu_ms / step_ms:.0%})")
        attention = sum(e.self_device_time_total for e in events if "attention" in e.key) / n / 1e3
        print(f"attention kernels {attention:.2f} ms a step")
        if not args.no_table:
            print(events.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
            print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-8b-shape")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--ungrouped", action="store_true",
                        help="attention a program per query head past the GEMV rows too (as before grouping)")
    parser.add_argument("--no-table", action="store_true", help="the figures only, not the profiler's tables")
    parser.add_argument("--chunk", type=int, help="cached positions per attention program past the GEMV rows")
    parser.add_argument("--warps", type=int, help="warps per attention program past the GEMV rows")
    parser.add_argument("--tile", type=int, help="positions per tensor-core dot of a grouped program (0: the "
                                                 "group's heads one by one)")
    args = parser.parse_args()
    from hpc.runtime.engine.kernels import decode_kernels

    decode_kernels.ATTN_GROUPED_BATCHED = not args.ungrouped
    decode_kernels.ATTN_CHUNK_BATCHED = args.chunk or decode_kernels.ATTN_CHUNK_BATCHED
    decode_kernels.ATTN_WARPS_BATCHED = args.warps or decode_kernels.ATTN_WARPS_BATCHED
    decode_kernels.ATTN_TILE = decode_kernels.ATTN_TILE if args.tile is None else args.tile
    if not torch.cuda.is_available():
        sys.exit("decode_profile: needs a CUDA GPU")
    asyncio.run(measure(ensure_model(f"~/.cache/hpc/models/{args.model}", args.model), args))


if __name__ == "__main__":
    main()
