"""Faults under load: kill a decode worker, NATS and etcd, and pause etcd, while requests flow; count lost and
hung requests and time each recovery.

    python benchmarks/faults.py [--requests 5000] [--concurrency 64]            # the stack on this machine
    hpc dev-cluster up && python benchmarks/faults.py --cluster dev             # the stack as a Slurm job

tiny-disagg on the mock engine with 2 decode workers that restart on failure. One fault at a time, each once
the stack has recovered from the previous one (plus a second), while the load runs: SIGKILL decode-0, SIGKILL
the NATS server, SIGKILL the etcd server, then SIGSTOP etcd for 11 s (longer than every worker's lease) and
SIGCONT it. The load keeps going until at least --requests have been sent and every fault has recovered. A
request is lost when it does not answer 200, hung when it has no answer within 30 s. "out of routing" is how
long until the frontend stopped routing to the killed worker; "recovered" runs from the fault until the stack
is whole again: the worker back in /health, the server restarted by its step and healthy, or (the pause) every
worker registered again after etcd resumed. The dev cluster's nodes share this host's PID namespace, so the
processes named in the run's state files are signalled directly.
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from _stack import local_stack  # noqa: E402

from hpc.net.httpclient import Pool  # noqa: E402
from hpc.checks.probe import get_json  # noqa: E402
from hpc.rundir import read_json  # noqa: E402

HUNG_S = 30.0
PAUSE_S = 11.0
STACK = ("tiny-disagg", "backend=mock", "mock.per_token_delay_ms=2", "roles.decode.count=2",
         "roles.decode.failure.on_failure=restart", "roles.decode.failure.max_restarts=10")


def live(url: str) -> dict[str, int]:
    _, body = get_json(url + "/health")
    return body.get("live", {}) if isinstance(body, dict) else {}


async def wait_for(check, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    while not await asyncio.to_thread(check):
        if time.monotonic() - t0 > timeout:
            return float("nan")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


class Faults:
    def __init__(self, url: str, state_dir: Path) -> None:
        self.url, self.state_dir = url, state_dir
        self.rows: list[list[str]] = []
        self.whole = live(url)
        self.current = "before"  # the fault whose window a failed request falls in
        self.failed: dict[str, int] = {}
        self.why: dict[str, int] = {}  # what the failed requests got (status, or the exception's name)

    def state(self, name: str) -> dict:
        return read_json(self.state_dir / f"{name}.json") or {}

    def is_whole(self) -> bool:
        now = live(self.url)
        return all(now.get(role, 0) >= n for role, n in self.whole.items())

    async def kill_worker(self, name: str) -> None:
        os.kill(self.state(name)["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        gone = await wait_for(lambda: live(self.url).get("decode", 0) < self.whole["decode"], 10)
        await wait_for(self.is_whole)
        self.rows.append([name, "SIGKILL worker", f"{gone:.2f}", f"{time.monotonic() - t0:.2f}"])

    async def kill_server(self, name: str) -> None:
        restarts = self.state(name).get("restarts", 0)
        os.kill(self.state(name)["server_pid"], signal.SIGKILL)
        t0 = time.monotonic()

        def restarted() -> bool:
            now = self.state(name)
            return now.get("restarts", 0) > restarts and now.get("phase") == "ready" and self.is_whole()
        await wait_for(restarted)
        self.rows.append([name, "SIGKILL server", "-", f"{time.monotonic() - t0:.2f}"])

    async def pause_etcd(self) -> None:
        pid = self.state("etcd")["server_pid"]
        os.kill(pid, signal.SIGSTOP)
        fewest = dict(self.whole)
        t_end = time.monotonic() + PAUSE_S
        while time.monotonic() < t_end:  # what the frontend keeps routing to while discovery is frozen
            now = await asyncio.to_thread(live, self.url)
            fewest = {role: min(fewest[role], now.get(role, 0)) for role in fewest}
            await asyncio.sleep(0.1)
        os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        after = dict(self.whole)
        t_watch = time.monotonic() + 5.0
        while time.monotonic() < t_watch:  # ...and when the leases that lapsed meanwhile expire on resume
            now = await asyncio.to_thread(live, self.url)
            after = {role: min(after[role], now.get(role, 0)) for role in after}
            await asyncio.sleep(0.05)
        await wait_for(self.is_whole)
        routed = " ".join(f"{r}={fewest[r]}/{after[r]}" for r in sorted(fewest))
        self.rows.append([f"etcd ({routed})", f"SIGSTOP {PAUSE_S:.0f} s", "-", f"{time.monotonic() - t0:.2f}"])

    async def run_all(self) -> None:
        for name, step in (("decode-0", lambda: self.kill_worker("decode-0")), ("nats", lambda: self.kill_server("nats")),
                           ("etcd", lambda: self.kill_server("etcd")), ("etcd pause", self.pause_etcd)):
            await asyncio.sleep(1.0)
            self.current = name
            await step()
            self.rows[-1].append(str(self.failed.get(name, 0)))
        await asyncio.sleep(1.0)


async def run(url: str, state_dir: Path, requests: int, concurrency: int) -> tuple[dict[str, int], list]:
    pool = Pool(url)
    body = json.dumps({"model": "hpc/tiny", "prompt": "faults under load", "max_tokens": 8,
                       "ignore_eos": True}).encode()
    counts = {"ok": 0, "lost": 0, "hung": 0}
    faults = Faults(url, state_dir)
    schedule = asyncio.create_task(faults.run_all())

    async def one() -> None:
        conn = pool.take()
        ok = False
        why = "?"
        try:
            status, answer = await asyncio.wait_for(conn.request("POST", "/v1/completions", body), HUNG_S)
            ok = status == 200
            counts["ok" if ok else "lost"] += 1
            why = f"{status} {answer[:120]!r}"
        except asyncio.TimeoutError:
            counts["hung"] += 1
            why = "hung"
        except OSError as exc:
            counts["lost"] += 1
            why = type(exc).__name__
        finally:
            if not ok:
                faults.failed[faults.current] = faults.failed.get(faults.current, 0) + 1
                faults.why[why] = faults.why.get(why, 0) + 1
            pool.give(conn, ok)

    async def user() -> None:
        while sum(counts.values()) < requests or not schedule.done():
            await one()

    t0 = time.monotonic()
    await asyncio.gather(*[user() for _ in range(concurrency)])
    elapsed = time.monotonic() - t0
    await schedule
    pool.close()
    counts["sent"] = counts["ok"] + counts["lost"] + counts["hung"]
    counts["req_per_s"] = int(counts["sent"] / elapsed)
    for why, n in sorted(faults.why.items(), key=lambda item: -item[1])[:5]:
        print(f"failed x{n}: {why}", file=sys.stderr)
    return counts, faults.rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cluster", default=None, help="a Slurm cluster profile (dev); default: this machine")
    parser.add_argument("--set", action="append", default=[], help="a recipe override, e.g. frontend.router=kv_aware")
    args = parser.parse_args()
    with contextlib.redirect_stdout(io.StringIO()):
        stack = local_stack(*STACK, *args.set, cluster=args.cluster)
        run_dir, url = stack.__enter__()
    try:
        counts, rows = asyncio.run(run(url, run_dir.state, args.requests, args.concurrency))
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            stack.__exit__(None, None, None)
    where = f"a Slurm job on cluster '{args.cluster}'" if args.cluster else "this machine"
    print(f"faults under load, {where}: >= {args.requests} requests at c={args.concurrency}, "
          "tiny-disagg on the mock engine (2 decode workers)")
    print(f"{'sent':>6} {'ok':>6} {'lost':>5} {'hung':>5} {'req/s':>6}")
    print(f"{counts['sent']:>6} {counts['ok']:>6} {counts['lost']:>5} {counts['hung']:>5} {counts['req_per_s']:>6}")
    print(f"{'fault (routed during/after)':<34} {'how':<16} {'out of routing s':>17} {'recovered s':>12} "
          f"{'failed':>7}")
    for target, how, gone, back, failed in rows:
        print(f"{target:<34} {how:<16} {gone:>17} {back:>12} {failed:>7}")


if __name__ == "__main__":
    main()
