"""CPU time the frontend spends per streamed token, with the mock engine at zero delay (runs anywhere).

    python benchmarks/frontend_tokens.py [--concurrency 32] [--output-tokens 256] [--requests-per-user 4]

One frontend process (frontend.processes=1) between hpc bench's streaming client and one mock worker: the CPU
seconds of the frontend's process and of the worker's over one level, divided by the tokens the client received.
Every token is one server-sent event to the client and passes every layer of the frontend's output path (RPC
reply, router, detokenizer, stop strings, the SSE chunk, the HTTP write), so µs per token is what one frontend
process can serve: at 20 µs a token, one core streams 50k tokens/s. Client, frontend and worker share this
machine's cores; their CPU times are their own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import _profile  # noqa: E402
from _stack import local_stack  # noqa: E402
from stack_sweeps import group_cpu_seconds  # noqa: E402

from hpc.bench.clients import run_level  # noqa: E402
from hpc.bench.loadgen import Level  # noqa: E402
from hpc.launch.local import local_pids  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--requests-per-user", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="levels measured; the best is reported")
    parser.add_argument("--profile", metavar="DIR", help="then py-spy on the frontend through one more level "
                        "(which functions hold its GIL)")
    args = parser.parse_args()
    level = Level(args.concurrency, 16, args.output_tokens, args.requests_per_user * args.concurrency)
    with contextlib.redirect_stdout(io.StringIO()):
        stack = local_stack("mock-agg", "frontend.processes=1")
        run, url = stack.__enter__()
    try:
        leaders = {name: pids[0] for name, pids in local_pids(run).items() if name in ("frontend", "agg-0")}

        async def rounds() -> list[tuple[float, float, float]]:
            await run_level(url, "hpc/mock", Level(4, 16, 16, 16), True, 0)  # connections and code paths warm
            out = []
            for i in range(args.rounds):
                cpu0 = {name: group_cpu_seconds(pid) for name, pid in leaders.items()}
                t0 = time.perf_counter()
                result = await run_level(url, "hpc/mock", level, True, 0, seed=i)
                wall = time.perf_counter() - t0
                tokens = result["output_tokens_per_s"] * result["duration_s"]
                cpu = {name: group_cpu_seconds(pid) - cpu0[name] for name, pid in leaders.items()}
                out.append((cpu["frontend"] / tokens * 1e6, cpu["agg-0"] / tokens * 1e6,
                            result["output_tokens_per_s"], cpu["frontend"] / wall))
            if args.profile:
                longer = Level(args.concurrency, 16, args.output_tokens, 4 * level.requests)
                load = asyncio.create_task(run_level(url, "hpc/mock", longer, True, 0, seed=args.rounds))
                await asyncio.sleep(0.3)
                spies = _profile.record({"frontend": leaders["frontend"]}, 2, Path(args.profile))
                await load
                for _, mode, path, spy in spies:
                    await asyncio.to_thread(spy.communicate)
                    profile.extend(_profile.summary(path, mode) if path.is_file() else [f"  py-spy ({mode}) failed"])
            return out

        profile: list[str] = []
        measured = asyncio.run(rounds())
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            stack.__exit__(None, None, None)
    best = min(measured)
    print(f"frontend CPU per streamed token, mock engine at zero delay, c={args.concurrency}, "
          f"{args.output_tokens} tokens a request, one frontend process, {os.cpu_count()} CPUs shared by client, "
          f"frontend and worker; best of {args.rounds} rounds")
    print(f"  frontend  {best[0]:6.1f} µs a token   rounds " + " / ".join(f"{m[0]:.1f}" for m in measured))
    print(f"  worker    {best[1]:6.1f} µs a token   rounds " + " / ".join(f"{m[1]:.1f}" for m in measured))
    print(f"  tokens/s through the stack {best[2]:,.0f}; the frontend busy {best[3]:.2f} cores")
    if profile:
        print(f"profile of the frontend (py-spy, files in {args.profile}):", *profile, sep="\n")


if __name__ == "__main__":
    main()
