"""Cache-aware routing against round robin on a shared-prefix workload, same workload, one stack per policy.

    python benchmarks/kv_routing.py [--workers 4] [--prefixes 16] [--prefix-tokens 512] [--requests 256]

Each request is one of `--prefixes` long system prompts (picked with a skew: a few are popular, as in chat
traffic) followed by a short user part of 8-64 tokens; `--concurrency` clients send them streamed. The stack is
tiny-agg with `--workers` aggregated workers whose prefix caches hold about 5 of the prefixes each (a finite
cache, as a real one: round robin makes every worker cache every prefix, kv_aware splits them). Reported per policy: prompt tokens the engines computed (the
rest came from their prefix caches), the cache hit rate (cached / prompt tokens), TTFT p50 / p99, and the
requests each worker got. Goal (issue #16): kv_aware computes >= 2 x fewer prompt tokens, with a lower TTFT p50.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from _stack import local_stack  # noqa: E402
from _stack import counters, workers  # noqa: E402

from hpc.net.httpclient import Pool  # noqa: E402


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, 3000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    weights = [1 / (i + 1) for i in range(args.prefixes)]  # Zipf-like popularity
    return [rng.choices(prefixes, weights)[0] + [rng.randrange(100, 3000) for _ in range(rng.randint(8, 64))]
            for _ in range(args.requests)]


async def send(url: str, model: str, prompts: list[list[int]], concurrency: int) -> list[float]:
    """TTFT of every request (streamed completions, 8 tokens each)."""
    pool, queue, ttfts = Pool(url), list(reversed(prompts)), []

    async def one(prompt: list[int]) -> None:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                           "stream": True}).encode()
        conn, t0, first, body_seen = pool.take(), time.perf_counter(), [], []

        def on_piece(piece: bytes) -> None:
            body_seen.append(piece)
            if not first and b'"text"' in piece:
                first.append(time.perf_counter() - t0)
        status = await conn.stream("POST", "/v1/completions", body, on_piece)
        if status != 200:
            raise SystemExit(f"HTTP {status}: {b''.join(body_seen)[:200]!r}")
        pool.give(conn, True)
        ttfts.append(first[0] if first else time.perf_counter() - t0)

    async def user() -> None:
        while queue:
            await one(queue.pop())
    await asyncio.gather(*[user() for _ in range(concurrency)])
    return ttfts


def run(policy: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    overrides = [f"roles.agg.count={args.workers}", f"frontend.router={policy}",
                 'roles.agg.override_engine_args={"max_batch_size": 16, "kv_cache_config": '
                 f'{{"max_tokens": {args.cache_tokens}}}}}', "limits.max_input_tokens=2048",
                 *([f"frontend.kv_overlap_weight={args.overlap_weight}"] if args.overlap_weight is not None else [])]
    with contextlib.redirect_stdout(io.StringIO()):
        stack = local_stack("tiny-agg", *overrides)
        run_dir, url = stack.__enter__()
    try:
        model = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=10).read())["data"][0]["id"]
        ttfts = asyncio.run(send(url, model, prompts, args.concurrency))
        stats = {name: counters(state["http"]) for name, state in workers(Path(run_dir.path)).items()}
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            stack.__exit__(None, None, None)
    prompt = sum(s.get("prompt_tokens", 0) for s in stats.values())
    ttfts.sort()
    return {"policy": policy, "computed": sum(s.get("prompt_tokens_computed", 0) for s in stats.values()),
            "prompt": prompt, "cached": sum(s.get("prompt_tokens_cached", 0) for s in stats.values()),
            "ttft_p50": statistics.median(ttfts), "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "per_worker": {name: int(s.get("requests", 0)) for name, s in sorted(stats.items())}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overlap-weight", type=float, help="frontend.kv_overlap_weight (default: the recipe's)")
    parser.add_argument("--cache-tokens", type=int, default=2560,
                        help="each worker's prefix cache (kv_cache_config.max_tokens): about 5 of the 16 prefixes")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    prompts = workload(args)
    results = [run(policy, prompts, args) for policy in ("round_robin", "kv_aware")]
    print(f"{args.requests} requests, {args.prefixes} shared prefixes of {args.prefix_tokens} tokens, "
          f"{args.workers} workers with {args.cache_tokens}-token prefix caches, concurrency {args.concurrency}")
    print(f"{'policy':<12} {'prompt tok':>10} {'computed':>9} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p99':>9}  "
          f"requests per worker")
    for r in results:
        print(f"{r['policy']:<12} {r['prompt']:>10.0f} {r['computed']:>9.0f} {r['cached'] / r['prompt']:>9.1%} "
              f"{r['ttft_p50'] * 1000:>7.1f}ms {r['ttft_p99'] * 1000:>7.1f}ms  {r['per_worker']}")
    rr, kv = results
    print(f"kv_aware computes {rr['computed'] / max(kv['computed'], 1):.2f}x fewer prompt tokens; "
          f"TTFT p50 {kv['ttft_p50'] / rr['ttft_p50']:.0%} of round robin's")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
