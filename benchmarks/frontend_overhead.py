"""Frontend overhead with the mock engine at zero delay: frontend vs calling the worker directly.

    python benchmarks/frontend_overhead.py [--seconds 5]

Reports p50/p99 latency at concurrency 1 and requests/s at concurrency 32, both paths, on this machine
(client, frontend and worker share its cores). Target: <= 1.0 ms added p50 at c=1, >= 2,000 req/s at c=32.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _stack import local_stack  # noqa: E402

from hpc.net.httpclient import Pool  # noqa: E402
from hpc.runtime.services.node import rpc_token  # noqa: E402
from hpc.runtime.serve.rpc import RpcClient  # noqa: E402
from hpc.runtime.serve.wire import GenerateRequest, SamplingParams  # noqa: E402

MAX_TOKENS = 4


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def drive(call, concurrency: int, seconds: float) -> tuple[list[float], float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def user() -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    for _ in range(50):  # warm-up
        await call()
    t0 = time.perf_counter()
    await asyncio.gather(*[user() for _ in range(concurrency)])
    return latencies, len(latencies) / (time.perf_counter() - t0)


async def measure(url: str, worker: tuple[str, int], token: str | None, seconds: float) -> list[list[str]]:
    body = json.dumps({"model": "hpc/mock", "prompt": "hello world", "max_tokens": MAX_TOKENS}).encode()
    pool = Pool(url)

    async def via_frontend() -> None:
        conn = pool.take()
        status, _ = await conn.request("POST", "/v1/completions", body)
        pool.give(conn, status == 200)
        assert status == 200

    client = RpcClient(*worker, token=token)  # the job's RPC token, as the frontend sends it
    request = GenerateRequest(request_id="b", token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=MAX_TOKENS),
                              streaming=False)

    async def direct() -> None:
        async for _ in client.stream(request):
            pass

    rows = []
    results = {}
    for name, call in (("worker direct", direct), ("through frontend", via_frontend)):
        lat1, _ = await drive(call, 1, seconds)
        _, rps = await drive(call, 32, seconds)
        results[name] = (statistics.median(lat1), pct(lat1, 0.99), rps)
        rows.append([name, f"{results[name][0] * 1e3:.3f}", f"{results[name][1] * 1e3:.3f}", f"{rps:,.0f}"])
    added50 = (results["through frontend"][0] - results["worker direct"][0]) * 1e3
    added99 = (results["through frontend"][1] - results["worker direct"][1]) * 1e3
    rows.append(["added by frontend", f"{added50:.3f}", f"{added99:.3f}", ""])
    await client.close()
    pool.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with contextlib.redirect_stdout(io.StringIO()):
        stack = local_stack("mock-agg", "mock.per_token_delay_ms=0", "mock.prefill_delay_ms=0")
        run, url = stack.__enter__()
    try:
        w = run.manifest().plan.workers[0]
        rows = asyncio.run(measure(url, ("127.0.0.1", w.ports["rpc"]), rpc_token(run.manifest()), args.seconds))
    finally:
        stack.__exit__(None, None, None)
    print(f"frontend overhead, mock engine at zero delay, {MAX_TOKENS} tokens per request, "
          f"{os.cpu_count()} CPUs shared by client, frontend and worker")
    print(f"{'path':<20} {'p50 ms (c=1)':>13} {'p99 ms (c=1)':>13} {'req/s (c=32)':>13}")
    for r in rows:
        print(f"{r[0]:<20} {r[1]:>13} {r[2]:>13} {r[3]:>13}")


if __name__ == "__main__":
    main()
