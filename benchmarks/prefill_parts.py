"""The host's cost of each part of a graphed prefill step, with the device idle before each call (so a figure is the
launch cost alone, not a wait for work queued earlier): the inputs staged and copied, the graph's replay, the
first tokens picked on the device, the prompts' blocks copied into the prefix cache's pool (as the engine does,
from a captured graph on a GPU, and eagerly) and the whole store.

    python benchmarks/prefill_parts.py [--prompts 1,4,8] [--input-tokens 64] [--repeats 200]

A prefill step's host time is what a closed loop's arriving requests wait behind (an engine process's link, then
their own step): 1.0-1.2 ms a step on an H200 (engine_steps.py), where the graphed decode step beside it is
0.1-0.2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_throughput import device_label, direct_engine_args  # noqa: E402

from hpc.bench.loadgen import prompt_ids  # noqa: E402
from hpc.runtime.engine.torch.sampling import on_device  # noqa: E402
from hpc.runtime.engine.torch.sequence import Seq  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402


def timed(sync: Callable[[], None], call: Callable[[], object], repeats: int) -> float:
    """Median host µs of `call`, the device idle before each."""
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", default="1,4,8")
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    counts = [int(n) for n in args.prompts.split(",")]
    rng = random.Random(0)

    async def run() -> None:
        engine_args = direct_engine_args(args.input_tokens, 64, 0, max(counts), {})
        async with TorchEngine(ensure_model(f"~/.cache/hpc/models/{args.model}", args.model),
                               DisaggregationMode.AGGREGATED, engine_args) as engine:
            import torch

            sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
            # the scheduler thread is idle between requests: these calls stand in for it, one at a time
            print(f"a prefill step's parts, host µs (median of {args.repeats}, the device idle before each), "
                  f"{args.model} on {device_label(engine)}, {args.input_tokens}-token prompts, temperature "
                  f"{args.temperature}, prefill graphs {'on' if engine.core.prefill_graphs is not None else 'off'}")
            print(f"{'prompts':>8} {'replay (staged)':>16} {'replay alone':>14} {'pick':>8} {'pool copy':>10} "
                  f"{'(eagerly)':>12} {'store (all)':>12}")
            for n in counts:
                seqs = []
                for slot in range(n):
                    request = GenerateRequest(request_id=f"p{slot}", token_ids=prompt_ids(args.input_tokens, rng),
                                              sampling=SamplingParams(max_tokens=8, temperature=args.temperature))
                    seqs.append(Seq(request=request, emit=lambda out: None, slot=slot))
                rows = [s.request.token_ids for s in seqs]
                slots = [s.slot for s in seqs]
                graphs = engine.core.prefill_graphs
                replay = timed(sync, lambda: graphs.run(rows, slots) if graphs is not None
                               else engine.context._padded_prefill(seqs, rows, last_only=True), args.repeats)
                logits = graphs.run(rows, slots) if graphs is not None \
                    else engine.context._padded_prefill(seqs, rows, last_only=True)
                core = engine.core
                pick = timed(sync, lambda: core.picker.pick_on_device(seqs, logits, core.sampler), args.repeats)
                prefix = engine.core.prefix
                blocks = args.input_tokens // prefix.block
                taken = {row: (slots[row % n], row // n) for row in range(n * blocks)}
                pool = timed(sync, lambda: prefix._copy_in(taken), args.repeats)

                def store() -> None:  # new prompts each time: their blocks are not in the pool yet
                    prefix.store_all([(prompt_ids(args.input_tokens, rng), slot) for slot in slots])
                fresh = timed(sync, store, args.repeats) - timed(sync, lambda: [prompt_ids(args.input_tokens, rng)
                                                                                 for _ in slots], args.repeats)
                alone = float("nan")
                if graphs is not None:
                    total = sum(map(len, rows))
                    count = next(c for c in graphs.token_counts if c >= total)
                    alone = timed(sync, graphs._graphs[count][0], args.repeats)
                rows_slots_blocks = [list(taken), [s for s, _ in taken.values()], [i for _, i in taken.values()]]
                eager = timed(sync, lambda: prefix._copy(*on_device(rows_slots_blocks, prefix.pool.device)),
                              args.repeats)
                print(f"{n:>8} {replay:>16.0f} {alone:>14.0f} {pick:>8.0f} {pool:>10.0f} {eager:>12.0f} "
                      f"{fresh:>12.0f}")

    asyncio.run(run())


if __name__ == "__main__":
    main()
