"""Faults under load: kill a decode worker, NATS and etcd while requests flow; count lost and hung requests.

    python benchmarks/faults.py [--requests 5000] [--concurrency 64]

The disaggregated stack (tiny-disagg, mock engine, 2 decode workers that restart on failure) runs on this
machine. At 20 %, 45 % and 70 % of the requests the benchmark SIGKILLs decode-0, then the NATS server, then the
etcd server. A request is lost when it does not answer 200, hung when it has no answer within 30 s. Recovery is
the time from the kill until the stack is whole again (the worker back in /health; the server restarted and
healthy, as its step reports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _stack import local_stack  # noqa: E402

from hpc.bench.httpclient import Pool  # noqa: E402
from hpc.checks.probe import get_json  # noqa: E402
from hpc.rundir import read_json  # noqa: E402

HUNG_S = 30.0


def decode_live(url: str) -> int:
    status, body = get_json(url + "/health")
    return body["live"].get("decode", 0) if isinstance(body, dict) else 0


async def wait_for(check, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    while not await asyncio.to_thread(check):
        if time.monotonic() - t0 > timeout:
            return float("nan")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def run(url: str, state_dir, requests: int, concurrency: int) -> tuple[dict[str, int], list[list[str]]]:
    pool = Pool(url)
    body = json.dumps({"model": "hpc/tiny", "prompt": "faults under load", "max_tokens": 8,
                       "ignore_eos": True}).encode()
    counts = {"ok": 0, "lost": 0, "hung": 0}
    done = 0
    next_index = 0
    faults: list[list[str]] = []
    plan = {int(requests * 0.20): "decode-0", int(requests * 0.45): "nats", int(requests * 0.70): "etcd"}
    recoveries: list[asyncio.Task] = []

    async def one() -> None:
        nonlocal done
        conn = pool.take()
        ok = False
        try:
            status, _ = await asyncio.wait_for(conn.request("POST", "/v1/completions", body), HUNG_S)
            ok = status == 200
            counts["ok" if ok else "lost"] += 1
        except asyncio.TimeoutError:
            counts["hung"] += 1
        except OSError:
            counts["lost"] += 1
        finally:
            pool.give(conn, ok)
            done += 1

    async def fault(target: str) -> None:
        state = read_json(state_dir / f"{target}.json") or {}
        t0 = time.monotonic()
        if target.startswith("decode"):
            os.kill(state["pid"], signal.SIGKILL)
            gone = await wait_for(lambda: decode_live(url) < 2, 10)
            back = await wait_for(lambda: decode_live(url) == 2)
            faults.append([target, "SIGKILL worker", f"{gone:.2f}", f"{gone + back:.2f}"])
            return
        restarts = state.get("restarts", 0)
        os.kill(state["server_pid"], signal.SIGKILL)

        def restarted() -> bool:
            now = read_json(state_dir / f"{target}.json") or {}
            return now.get("restarts", 0) > restarts and now.get("phase") == "ready"

        back = await wait_for(restarted)
        faults.append([target, "SIGKILL server", "-", f"{back:.2f}"])
        del t0

    async def user() -> None:
        nonlocal next_index
        while next_index < requests:
            index = next_index
            next_index += 1
            if index in plan:
                recoveries.append(asyncio.create_task(fault(plan[index])))
            await one()

    t0 = time.monotonic()
    await asyncio.gather(*[user() for _ in range(concurrency)])
    elapsed = time.monotonic() - t0
    await asyncio.gather(*recoveries)
    pool.close()
    counts["req_per_s"] = int(done / elapsed)
    return counts, faults


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    with contextlib.redirect_stdout(io.StringIO()):
        stack = local_stack("tiny-disagg", "backend=mock", "mock.per_token_delay_ms=2", "roles.decode.count=2",
                            "roles.decode.failure.on_failure=restart", "roles.decode.failure.max_restarts=10")
        run_dir, url = stack.__enter__()
    try:
        counts, faults = asyncio.run(run(url, run_dir.state, args.requests, args.concurrency))
    finally:
        stack.__exit__(None, None, None)
    print(f"faults under load on this machine: {args.requests} requests at c={args.concurrency}, "
          "tiny-disagg on the mock engine (2 decode workers)")
    print(f"{'requests ok':>12} {'lost':>5} {'hung':>5} {'req/s':>6}")
    print(f"{counts['ok']:>12} {counts['lost']:>5} {counts['hung']:>5} {counts['req_per_s']:>6}")
    print(f"{'fault':<10} {'how':<16} {'out of routing s':>17} {'recovered s':>12}")
    for target, how, gone, back in faults:
        print(f"{target:<10} {how:<16} {gone:>17} {back:>12}")


if __name__ == "__main__":
    main()
