"""How long decoding streams wait while long prompts arrive: prompts prefilled whole, or in chunks between the
decode steps (TensorRT-LLM's enable_chunked_prefill, the chunk bounded by max_num_tokens).

    python benchmarks/chunked_prefill.py                               # tiny model, CPU or the GPU here
    python benchmarks/chunked_prefill.py --model llama-8b-shape --long-tokens 4096 --budgets 8192,2048,512

`--decoders` requests decode `--output-tokens` each from short prompts; while they run, `--long` prompts of
`--long-tokens` arrive, the i-th when the first decoder has its (20 + 30 i)-th token (the same moments on any
device). Per configuration: the decoders' gaps between tokens (p50 / p99 / max: what a reader of those streams
sees), the long prompts' time to first token, and the decoders' tokens per second. One engine per configuration,
warmed by one round first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_throughput import device_label  # noqa: E402

from hpc.bench.loadgen import percentiles  # noqa: E402
from hpc.engine_args.precedence import TORCH_ENGINE_DEFAULTS, deep_update  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402


async def _round(engine: TorchEngine, args: argparse.Namespace, vocab: int, rng: random.Random) -> dict[str, float]:
    """One round: the decoders' token times and the long prompts' first-token times."""
    def request(ids: list[int], n: int) -> GenerateRequest:
        return GenerateRequest(request_id="b", token_ids=ids, sampling=SamplingParams(max_tokens=n, temperature=0,
                                                                                      ignore_eos=True))
    times: list[list[float]] = [[] for _ in range(args.decoders)]
    lead_tokens = asyncio.Event()
    moments = [20 + 30 * i for i in range(args.long)]

    async def decoder(i: int) -> None:
        ids = [rng.randrange(2, vocab) for _ in range(16)]
        async for out in engine.generate(request(ids, args.output_tokens)):
            times[i].extend([time.perf_counter()] * len(out.token_ids))
            if i == 0:
                lead_tokens.set()

    async def long_prompt() -> float:
        ids = [rng.randrange(2, vocab) for _ in range(args.long_tokens)]
        t0 = time.perf_counter()
        async for _ in engine.generate(request(ids, 4)):
            return time.perf_counter() - t0
        return float("nan")

    t0 = time.perf_counter()
    decoders = [asyncio.create_task(decoder(i)) for i in range(args.decoders)]
    longs = []
    for moment in moments:
        while len(times[0]) < moment:
            lead_tokens.clear()
            await lead_tokens.wait()
        longs.append(asyncio.create_task(long_prompt()))
    await asyncio.gather(*decoders)
    ttft = await asyncio.gather(*longs)
    wall = time.perf_counter() - t0
    gaps = [b - a for row in times for a, b in zip(row, row[1:])]
    spread = percentiles(gaps)
    return {"p50": spread["p50"], "p99": spread["p99"], "max": max(gaps),
            "ttft": statistics.median(ttft), "ttft_max": max(ttft),
            "tok_s": sum(map(len, times)) / wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=160)
    parser.add_argument("--long", type=int, default=4, help="long prompts per round")
    parser.add_argument("--long-tokens", type=int, default=1536)
    parser.add_argument("--budgets", default="8192,512,256",
                        help="max_num_tokens of each chunked configuration (the first row is always whole)")
    parser.add_argument("--engine-args", default="{}")
    args = parser.parse_args()
    model = ensure_model(f"~/.cache/hpc/models/{args.model}", args.model)
    base = deep_update(TORCH_ENGINE_DEFAULTS, {"max_seq_len": args.long_tokens + args.output_tokens + 64,
                                               "max_batch_size": args.decoders + args.long,
                                               **json.loads(args.engine_args)})
    configs = [("whole", {"max_num_tokens": max(8192, args.long_tokens)})] + [
        (f"chunked, max_num_tokens {budget}", {"enable_chunked_prefill": True, "max_num_tokens": int(budget)})
        for budget in args.budgets.split(",")]

    async def run() -> tuple[str, list[tuple[str, dict[str, float], int]]]:
        rows, label = [], ""
        for name, extra in configs:
            async with TorchEngine(model, DisaggregationMode.AGGREGATED, {**base, **extra}) as engine:
                vocab = engine.core.cfg.vocab_size
                await _round(engine, args, vocab, random.Random(1))  # warm: this configuration's shapes
                result = await _round(engine, args, vocab, random.Random(2))
                rows.append((name, result, int(engine.stats().get("prefill_chunks", 0))))
                label = device_label(engine)
        return label, rows

    label, rows = asyncio.run(run())
    print(f"{args.model} on {label}: {args.decoders} decoders x {args.output_tokens} tokens, {args.long} prompts of "
          f"{args.long_tokens} tokens arriving meanwhile")
    print(f"{'prefill':<32} {'gap p50 ms':>10} {'p99':>7} {'max':>7} {'long TTFT ms':>12} {'max':>7} "
          f"{'decode tok/s':>12} {'chunks':>6}")
    for name, r, chunks in rows:
        print(f"{name:<32} {r['p50'] * 1e3:>10.1f} {r['p99'] * 1e3:>7.1f} {r['max'] * 1e3:>7.1f} "
              f"{r['ttft'] * 1e3:>12.1f} {r['ttft_max'] * 1e3:>7.1f} {r['tok_s']:>12.0f} {chunks:>6}")


if __name__ == "__main__":
    main()
