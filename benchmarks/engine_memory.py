"""What one torch engine holds on its GPU once it says ready, by disaggregation mode: weights, the KV cache it
preallocates, and what its allocator keeps reserved beyond them (memory another worker sharing the GPU cannot use):

    python benchmarks/engine_memory.py [--model llama-8b-shape] [--modes prefill,decode,agg] [--max-seq-len 2048]
                                       [--max-batch-size 64] [--engine-args JSON]

One engine at a time, each emptied out of this process before the next. `device used` is what the driver says
the engine took (other processes' use left aside); `reserved` − `allocated` is its allocator's cache. Needs CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
from typing import Any

import torch

from hpc.engine_args.precedence import TORCH_ENGINE_DEFAULTS, deep_update
from hpc.runtime.engine.builds import ensure_model
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode

GIB = 2**30


async def held(model: Any, mode: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    gc.collect()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    async with TorchEngine(model, DisaggregationMode(mode), engine_args) as engine:
        stats = torch.cuda.memory_stats()
        cache = getattr(engine.core.cache, "whole", None)  # one tensor, every layer's K and V (llama.KvCache)
        row = {"mode": mode, "device_used_gib": (free_before - torch.cuda.mem_get_info()[0]) / GIB,
               "allocated_gib": stats["allocated_bytes.all.current"] / GIB,
               "reserved_gib": stats["reserved_bytes.all.current"] / GIB,
               "weights_gib": sum(p.numel() * p.element_size() for p in engine.core.model.parameters()) / GIB,
               "kv_gib": cache.numel() * cache.element_size() / GIB if cache is not None else None,
               "largest_blocks_gib": sorted((s["total_size"] / GIB for s in torch.cuda.memory_snapshot()),
                                            reverse=True)[:4]}
    gc.collect()
    torch.cuda.empty_cache()
    return row


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-8b-shape", help="a generated model kind (hpc.runtime.engine.models.tiny)")
    parser.add_argument("--modes", default="prefill,decode,agg")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--engine-args", default="{}", help="JSON merged over the engine args")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    model = ensure_model(f"~/.cache/hpc/models/{args.model}", args.model)
    engine_args = deep_update(TORCH_ENGINE_DEFAULTS, {"dtype": "bfloat16", "max_seq_len": args.max_seq_len,
                                                      "max_batch_size": args.max_batch_size,
                                                      **json.loads(args.engine_args)})
    rows = [await held(model, mode, engine_args) for mode in args.modes.split(",")]
    print(f"GiB on {torch.cuda.get_device_name(0)}, {args.model}, max_seq_len {args.max_seq_len}, "
          f"batch {args.max_batch_size}")
    print(f"{'mode':<8} {'weights':>8} {'KV':>7} {'allocated':>10} {'reserved':>9} {'device used':>12}  largest blocks")
    for r in rows:
        kv = f"{r['kv_gib']:.2f}" if r["kv_gib"] is not None else "-"
        print(f"{r['mode']:<8} {r['weights_gib']:>8.2f} {kv:>7} {r['allocated_gib']:>10.2f} {r['reserved_gib']:>9.2f} "
              f"{r['device_used_gib']:>12.2f}  {', '.join(f'{b:.2f}' for b in r['largest_blocks_gib'])}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
