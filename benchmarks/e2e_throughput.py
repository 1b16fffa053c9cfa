"""End-to-end tokens/s through the frontend vs calling the torch engine directly (same model, same load).

    python benchmarks/e2e_throughput.py [--concurrency 8] [--requests 32] [--output-tokens 64]

Goal: the stack keeps >= 95 % of the engine's tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from _stack import local_stack  # noqa: E402

from hpc.bench.loadgen import Level, prompt_ids, run_sweep  # noqa: E402
from hpc.runtime.engine.tiny import ensure_model  # noqa: E402
from hpc.runtime.engine.torch_engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402


async def engine_direct(model_dir: Path, level: Level) -> float:
    rng = random.Random(0)
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {"max_seq_len": 768}) as engine:
        queue = list(range(level.requests))
        tokens = 0

        async def user() -> None:
            nonlocal tokens
            while queue:
                queue.pop()
                req = GenerateRequest(request_id="x", token_ids=prompt_ids(level.input_tokens, rng),
                                      sampling=SamplingParams(max_tokens=level.output_tokens, ignore_eos=True))
                async for out in engine.generate(req):
                    tokens += len(out.token_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*[user() for _ in range(level.concurrency)])
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are reported")
    args = parser.parse_args()
    level = Level(args.concurrency, args.input_tokens, args.output_tokens, args.requests)
    model_dir = ensure_model("~/.cache/hpc/models/tiny", "tiny")
    direct, via = [], []
    with contextlib.redirect_stdout(io.StringIO()):
        stack = local_stack("tiny-agg")
        run, url = stack.__enter__()
    try:  # alternate the two paths so machine noise hits both alike
        for _ in range(args.rounds):
            direct.append(asyncio.run(engine_direct(model_dir, level)))
            (res,) = run_sweep(url, "hpc/tiny", [level], streaming=True, warmup=2, show_progress=False)
            via.append(res["output_tokens_per_s"])
    finally:
        stack.__exit__(None, None, None)
    med_d, med_v = statistics.median(direct), statistics.median(via)
    print(f"end-to-end tokens/s, tiny torch model on CPU, c={level.concurrency}, {level.input_tokens} in / "
          f"{level.output_tokens} out, {level.requests} requests, {args.rounds} alternating rounds, "
          f"{os.cpu_count()} CPUs")
    print(f"{'path':<26} {'median':>8} {'min':>8} {'max':>8}")
    print(f"{'engine directly':<26} {med_d:>8.1f} {min(direct):>8.1f} {max(direct):>8.1f}")
    print(f"{'through frontend (SSE)':<26} {med_v:>8.1f} {min(via):>8.1f} {max(via):>8.1f}")
    print(f"{'kept (median / median)':<26} {med_v / med_d:>8.0%}")


if __name__ == "__main__":
    main()
