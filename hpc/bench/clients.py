"""A level's users spread over several client processes: one Python process parsing every streamed event saturates
its core at tens of thousands of events a second, and the level would measure the client (on two H200 at c=64 a
request took 20 ms longer end to end as the client saw it than as the frontend did; docs/performance-log.md).
AIPerf runs its load in worker processes for the same reason.

Each client process (`python -m hpc.bench.clients`, one JSON line of work on stdin) warms up, says it is ready,
waits for the word to go so that all start together, runs its share of the users and requests and writes its
samples as JSON to the file the work names (not to its stdout: a level's samples are hundreds of kB, and on the
GPU machines a client's stdout arrived cut at 192 kB after its uvloop run, exit status 0). The level's figures
are computed once over every process's samples; its wall time runs from the first process's start to the last
one's end (perf_counter is the machine's monotonic clock).
"""

from __future__ import annotations

import asyncio
import os
import json
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

from hpc.bench.engines import Snapshot
from hpc.bench.loadgen import Level, Sample, bar, collect, summarize

USERS_PER_PROCESS = 16  # `auto`: one client process per this many users


def processes_for(setting: int | str, concurrency: int, cores: int) -> int:
    """How many client processes a level of `concurrency` users gets: a number as given (an int or its digits, as
    a command line has it; never more than the users), or `auto`: one per USERS_PER_PROCESS users, at most half of
    this machine's cores (the stack under test may share them)."""
    if setting == "auto":
        return max(1, min(-(-concurrency // USERS_PER_PROCESS), cores // 2))
    return max(1, min(int(setting), concurrency))


def shares(level: Level, processes: int) -> list[Level]:
    """The level split over `processes`: users and requests as evenly as they go, each share at least one user."""
    n = max(1, min(processes, level.concurrency))
    users = [level.concurrency // n + (i < level.concurrency % n) for i in range(n)]
    requests = [level.requests * u // level.concurrency for u in users]
    for i in range(level.requests - sum(requests)):  # what integer division left over
        requests[i % n] += 1
    return [replace(level, concurrency=u, requests=r) for u, r in zip(users, requests)]


async def run_apart(url: str, model: str, level: Level, streaming: bool, warmup: int, seed: int | str,
                    processes: int, progress: Callable[[int, int], None] = lambda done, total: None,
                    ) -> dict[str, Any]:
    """The level's figures with its users in `processes` client processes (even one: apart from this process)."""
    parts = shares(level, processes)
    with tempfile.TemporaryDirectory(prefix="hpc-bench-") as folder:
        return await _run_parts(url, model, level, streaming, warmup, seed, parts, Path(folder), progress)


def _pipes(client: asyncio.subprocess.Process) -> tuple[asyncio.StreamWriter, asyncio.StreamReader]:
    if client.stdin is None or client.stdout is None:
        raise RuntimeError("a client process of the load generator has no pipes")
    return client.stdin, client.stdout


async def _run_parts(url: str, model: str, level: Level, streaming: bool, warmup: int, seed: int | str,
                     parts: list[Level], folder: Path, progress: Callable[[int, int], None]) -> dict[str, Any]:
    clients = [await asyncio.create_subprocess_exec(sys.executable, "-m", "hpc.bench.clients",
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
               for _ in parts]
    try:
        for i, (client, part) in enumerate(zip(clients, parts)):
            work = {"url": url, "model": model, "level": asdict(part), "streaming": streaming,
                    "warmup": -(-warmup // len(parts)), "seed": f"{seed}/{i}",  # prompts of its own per process
                    "out": str(folder / f"client-{i}.json")}
            stdin, _ = _pipes(client)
            stdin.write(json.dumps(work).encode() + b"\n")
            await stdin.drain()
        for client in clients:
            if (await _pipes(client)[1].readline()).strip() != b"ready":
                raise RuntimeError("a client process of the load generator failed before the level (its stderr "
                                   "says why)")
        for client in clients:  # all warmed up: they start together
            stdin, _ = _pipes(client)
            stdin.write(b"go\n")
            await stdin.drain()
        await asyncio.gather(*(client.communicate() for client in clients))
    finally:
        for client in clients:
            if client.returncode is None:
                client.kill()
                await client.wait()
    results = []
    for i, client in enumerate(clients):
        out = folder / f"client-{i}.json"
        if client.returncode != 0 or not out.exists():
            raise RuntimeError(f"a client process of the load generator exited with {client.returncode}")
        results.append(json.loads(out.read_text()))
    samples = [Sample(**s) for r in results for s in r["samples"]]
    progress(len(samples), level.requests)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    # each process's own peak, summed: they run side by side, each with its users all in flight
    return {**summarize(level, samples, wall, peak_inflight=sum(r["peak"] for r in results)),
            "client_processes": len(parts), "client_cpu_s": sum(r["cpu_s"] for r in results)}


async def _client(work: dict[str, Any]) -> dict[str, Any]:
    import time

    async def ready() -> None:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)

    cpu0 = time.process_time()
    samples, start, end, peak = await collect(work["url"], work["model"], Level(**work["level"]), work["streaming"],
                                              work["warmup"], seed=work["seed"], ready=ready)
    return {"samples": [asdict(s) for s in samples], "start": start, "end": end, "peak": peak,
            "cpu_s": time.process_time() - cpu0}


def run_client(coro: Any) -> Any:
    """asyncio.run, on uvloop where it is installed (the serve extra brings it): its transports took some 15 % less
    of a client process's CPU a streamed token than asyncio's own loop (16.1-17.4 against 18.8-21.5 µs,
    benchmarks/client_tokens.py on a 2-CPU VM, alternating)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> int:
    work = json.loads(sys.stdin.readline())
    result = json.dumps(run_client(_client(work)))
    Path(work["out"] + ".part").write_text(result)
    Path(work["out"] + ".part").rename(work["out"])  # whole or absent: a client that died leaves no file
    return 0


if __name__ == "__main__":
    sys.exit(main())


async def run_level(url: str, model: str, level: Level, streaming: bool, warmup: int,
                    progress: Callable[[int, int], None] = lambda done, total: None, seed: int | str = 0,
                    processes: int = 1) -> dict[str, Any]:
    """One level's figures. `processes` > 1: its users spread over that many client processes (hpc.bench.clients),
    so that one process parsing every streamed event is not what the level measures."""
    if processes > 1 and not level.rate:
        return await run_apart(url, model, level, streaming, warmup, seed, processes, progress)
    samples, t0, t1, peak = await collect(url, model, level, streaming, warmup, progress, seed)
    return summarize(level, samples, t1 - t0, peak_inflight=None if level.rate else peak)


def run_sweep(url: str, model: str, levels: list[Level], streaming: bool, warmup: int,
              show_progress: bool = True, seed: int = 0, processes: int | str = 1,
              engines: Callable[[], Snapshot] | None = None,
              done: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each level in turn on the same warm engines; level i's prompts come from seed + i, so no level sends the
    prompts an earlier one sent (a prefix cache would find them all: one seed for every level made each level
    begin with the previous level's prompts). `processes`: client processes per level, or auto
    (hpc.bench.clients.processes_for). `engines`: the run's engine counters (hpc.bench.engines.EngineCounters), read
    before and after each level for the engines' share of a request's time (`in_engines`). `done`: each level's
    result is appended there as it ends, so that a sweep stopped midway (Ctrl-C) keeps the levels it finished."""
    from hpc.bench.engines import share_in_engines

    async def sweep() -> list[dict[str, Any]]:
        out = done if done is not None else []
        for i, lv in enumerate(levels):
            spread = processes_for(processes, lv.concurrency, os.cpu_count() or 1)
            label = f"c={lv.concurrency} in={lv.input_tokens} out={lv.output_tokens}"
            before = engines() if engines else {}
            result = await run_level(url, model, lv, streaming, warmup,
                                     bar(label) if show_progress else (lambda d, t: None), seed=seed + i,
                                     processes=spread)
            if engines:
                result["in_engines"] = share_in_engines(before, engines(), (result.get("e2e_s") or {}).get("mean"))
            out.append(result)
        return out

    return asyncio.run(sweep())
