"""Is the load generator the limit? One stack, the same total concurrency split over 1, 2 and 4 client processes.

    python benchmarks/client_capacity.py [--recipe tiny-agg] [--concurrency 64] [--clients 1,2,4]

One Python process parsing every streamed event saturates its core at tens of thousands of events a second,
possibly before the stack does; if more client processes get more tokens/s from the same stack, the
single-client figure measured the client (why `hpc bench` spreads its users over processes by default since
2026-11-26, hpc/bench/clients.py). Each client reports its own CPU time: near 100 % of the
wall time means it was busy all along.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _stack import add_set_option  # noqa: E402


def child(url: str, concurrency: int, requests: int, input_tokens: int, output_tokens: int, spread: int,
          seed: int) -> None:
    from hpc.bench.clients import run_level
    from hpc.bench.loadgen import Level

    level = Level(concurrency, input_tokens, output_tokens, requests, output_spread=spread)
    # warm, with prompts the level will not send again
    asyncio.run(run_level(url, "hpc/tiny", Level(1, input_tokens, output_tokens, 2), True, 0, seed=-1 - seed))
    print("ready", flush=True)
    sys.stdin.readline()  # every client starts together, once the parent has read the engines' counters
    cpu0, t0 = time.process_time(), time.perf_counter()
    res = asyncio.run(run_level(url, "hpc/tiny", level, True, 0, seed=seed))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    print(json.dumps({"tok_s": res["output_tokens_per_s"], "cpu_share": cpu / wall}))


def start_client(url: str, level, seed: int = 0) -> subprocess.Popen:
    """A load generator in a process of its own (as `hpc bench` is): warmed up, it waits for go()."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", url, str(level.concurrency), str(level.requests),
                             str(level.input_tokens), str(level.output_tokens), str(level.output_spread), str(seed)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def go(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def result(proc: subprocess.Popen) -> dict:
    """{"tok_s", "cpu_share"} of a client once its level ran."""
    return json.loads(proc.communicate()[0].strip().splitlines()[-1])


def cpu_seconds(group: int) -> float:
    """User + system time so far of every process in a process group (each component is one, all threads)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # pgrp
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# what engine_line reads from each worker
STEP_COUNTERS = ("decode_steps", "prefill_steps", "generated_tokens", "idle_seconds_total", "admit_seconds_total",
                 "decode_seconds_total")


def engine_counters(run) -> dict[str, dict[str, float]]:
    """Each registered worker's engine counters, from its /metrics."""
    from _stack import counters, workers

    return {name: counters(state["http"], STEP_COUNTERS) for name, state in workers(Path(run.path)).items()
            if state.get("http")}


def engine_line(was: dict[str, float], now: dict[str, float], wall: float) -> str:
    """An engine's steps over an interval, from two readings of its counters."""
    def delta(key: str) -> float:
        return now.get(key, 0.0) - was.get(key, 0.0)
    steps = delta("decode_steps")
    # shares of the scheduler's own accounted time: the readings need not bracket `wall` exactly
    accounted = max(delta("decode_seconds_total") + delta("admit_seconds_total") + delta("idle_seconds_total"), 1e-9)
    return (f"{steps / wall:.0f} decode steps/s of {delta('decode_seconds_total') / max(steps, 1) * 1e3:.2f} ms, "
            f"{delta('generated_tokens') / max(steps, 1):.1f} tokens per step, {delta('prefill_steps') / wall:.0f} "
            f"prefill steps/s; scheduler time: decode {delta('decode_seconds_total') / accounted:.0%}, admit "
            f"{delta('admit_seconds_total') / accounted:.0%}, idle {delta('idle_seconds_total') / accounted:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="tiny-agg")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--clients", default="1,2,4")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--output-spread", type=int, default=0)
    parser.add_argument("--py-spy", metavar="DIR", help="record the stack's Python processes (GIL holders, collapsed "
                        "stacks) for 5 s during the first client count, into DIR")
    add_set_option(parser)
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        url, *numbers = args.child
        child(url, *map(int, numbers))
        return
    from _stack import local_stack

    from hpc.bench.loadgen import Level
    from hpc.spec.catalog import load_recipe

    override = json.dumps({"max_batch_size": args.concurrency})
    with contextlib.redirect_stdout(io.StringIO()):
        recipe, _ = load_recipe(args.recipe)
        roles = [role for role in ("agg", "prefill", "decode") if getattr(recipe.roles, role) is not None]
        stack = local_stack(args.recipe, *(f"roles.{role}.override_engine_args={override}" for role in roles),
                            *args.overrides)
        run, url = stack.__enter__()
    from hpc.launch.local import local_pids

    components = {name: group[0] for name, group in local_pids(run).items()}
    rows = []
    try:
        for clients in (int(x) for x in args.clients.split(",")):
            each = args.concurrency // clients
            level = Level(each, 64, args.output_tokens, 4 * each, output_spread=args.output_spread)
            # started and warm: the measured window holds the level only
            procs = [start_client(url, level, seed=i) for i in range(clients)]
            counted = engine_counters(run)
            t0, before = time.perf_counter(), {name: cpu_seconds(pid) for name, pid in components.items()}
            spies = [] if not args.py_spy or rows else [subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--subprocesses", "--duration", "5", "--gil", "--nonblocking",
                 "--format", "raw", "--output", os.path.join(args.py_spy, f"{name}.txt")], stdout=subprocess.DEVNULL)
                for name, pid in components.items() if name not in ("etcd", "nats")]
            for proc in procs:
                go(proc)
            results = [result(p) for p in procs]
            wall = time.perf_counter() - t0
            busy = {name: (cpu_seconds(pid) - before[name]) / wall for name, pid in components.items()}
            for name, now in engine_counters(run).items():
                print(f"  {clients} client(s), {name}: {engine_line(counted[name], now, wall)}", file=sys.stderr)
            for spy in spies:
                spy.wait()
            rows.append((clients, each, sum(r["tok_s"] for r in results), [r["cpu_share"] for r in results], busy))
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            stack.__exit__(None, None, None)
    print(f"stack {args.recipe}, total concurrency {args.concurrency}, 64 in / {args.output_tokens} +- "
          f"{args.output_spread} out, 4 x concurrency requests per client")
    print(f"{'clients':>7} {'c each':>6} {'tok/s (sum)':>12}  CPU / wall: clients; stack processes")
    for clients, each, tok_s, cpu, busy in rows:
        print(f"{clients:>7} {each:>6} {tok_s:>12.0f}  {' '.join(f'{c:.0%}' for c in cpu)}; "
              f"{', '.join(f'{name} {share:.0%}' for name, share in busy.items())}")


if __name__ == "__main__":
    main()
