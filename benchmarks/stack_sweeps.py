"""The whole local stack, freshly launched, swept twice with hpc bench's load generator: the first sweep should be
as fast as the second (every worker warms up before it registers), and tokens/s should scale with concurrency.
Prints where each worker ran and how the KV crossed from prefill to decode (CUDA IPC or bytes).

    python benchmarks/stack_sweeps.py [--recipe tiny-disagg] [--concurrency 1,8,32,64] [--output-tokens 64]
                                      [--requests-per-user 128] [--min-requests 256]
                                      [--profile DIR [--profile-seconds 3]]
                                      [--json FILE]

Goals (issue #14, on a GPU machine): first sweep within 10 % of the second at every level; c=64 >= 20 x c=1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import _cpu_topology  # noqa: E402
import cpu_siblings  # noqa: E402
import _profile  # noqa: E402
from _cpu_speed import CpuSpeedLog  # noqa: E402
from _gpu_clocks import ClockLog  # noqa: E402
from _scheduler_clock import SCHEDULER_CLOCK, per_step, scheduler_cpu_speed, spent as clock_spent  # noqa: E402
from _stack import add_set_option, counters, local_stack, workers  # noqa: E402

from hpc.bench.clients import processes_for  # noqa: E402
from hpc.bench.clients import run_level  # noqa: E402
from hpc.bench.loadgen import REQUESTS_PER_USER, Level  # noqa: E402
from hpc.runtime.frontend.orchestration import DISAGG_PHASES  # noqa: E402
from hpc.launch.local import local_pids  # noqa: E402
from hpc.spec.catalog import load_recipe  # noqa: E402


# where each sweep's time went in each worker: what the first sweep pays more than the second shows here
SWEEP_COUNTERS = ("kv_ask_seconds_total", "kv_move_seconds_total", "kv_ipc_opened", "kv_ipc_open_seconds_total",
                  "cuda_malloc_segments", "admit_seconds_total", "decode_seconds_total", "idle_seconds_total",
                  "prefill_steps", "decode_steps", "decode_steps_graphed", "decode_steps_overlapped",
                  "decode_rows_joined_in_flight", "requests", "queue_seconds_total",
                  "first_tokens", "first_token_seconds_total", "kv_shared_with_answer", "kv_taken_from_answer",
                  "link_seconds_total", "task_start_seconds_total", "submit_seconds_total", "inbox_seconds_total",
                  "kv_ipc_copy_batches", "engine_gc_full_collections_total", "engine_gc_seconds_total",
                  "worker_gc_full_collections_total", "worker_gc_seconds_total", "stats_seconds_total",
                  "stats_made_total", "stats_cpu_seconds_total", "stats_engine_seconds_total",
                  "worker_idle_spin_seconds_total", "engine_idle_spin_seconds_total",
                  "engine_idle_spin_finds_total")


def group_cpu_seconds(leader: int) -> float:
    """CPU seconds (user + system) of every live process in `leader`'s process group (a local component and
    what it started: the frontend's other processes), from /proc."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in _cpu_topology.group(leader):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # fields 14 and 15: utime, stime
    return total


def frontend_latency(url: str) -> dict[str, float]:
    """The frontend's TTFT and request-duration sums (seconds) and request count so far (all its processes)."""
    from hpc.checks.probe import get_text, metric_values

    text = get_text(f"{url}/metrics")
    return {"ttft": metric_values(text, "hpc_frontend_time_to_first_token_seconds_sum"),
            "e2e": metric_values(text, "hpc_frontend_request_duration_seconds_sum"),
            "count": metric_values(text, "hpc_frontend_request_duration_seconds_count"),
            "gc": metric_values(text, "hpc_frontend_gc_seconds_total"),
            "gc_full": metric_values(text, "hpc_frontend_gc_full_collections_total"),
            "disagg": metric_values(text, "hpc_frontend_disagg_requests_total"),
            "loop_s": metric_values(text, "hpc_frontend_loop_latency_seconds_total"),
            "loop_n": metric_values(text, "hpc_frontend_loop_latency_probes_total"),
            **{phase: metric_values(text, f"hpc_frontend_{phase}") for phase in DISAGG_PHASES}}


def process_requests(url: str) -> list[float]:
    """Requests each frontend process took so far (none for a frontend of one process)."""
    from hpc.checks.probe import get_text, metric_by_label

    counts = metric_by_label(get_text(f"{url}/metrics"), "hpc_frontend_process_requests_total", "process")
    return [counts[i] for i in sorted(counts, key=int)]


def request_phases(concurrency: int, seen: list[dict[str, float]], clocks: list[dict[str, dict]]) -> str:
    """A disaggregated request's mean phases in the frontend, beside its time in each engine (from the engine's
    inbox to its last output): what the frontend waits for that no engine spends is the path between them."""
    def in_engine(clock: dict[str, float]) -> str:  # (a SCHEDULER_CLOCK difference: every key is there)
        requests, messages = clock["finished_requests_total"], clock["outputs_messages_total"]
        probes = max(clock["worker_loop_latency_probes_total"], 1)
        parts = [f"its worker's loop {clock['worker_loop_latency_seconds_total'] / probes * 1e3:.3f}"]
        if messages:  # an engine process: its link both ways (none for an engine in its worker's process)
            parts.insert(0, f"its link from the worker {clock['link_seconds_total'] / requests * 1e3:.2f}, of which "
                            f"before the scheduler looked {clock['link_unread_seconds_total'] / requests * 1e3:.2f}; "
                            f"an outputs message back {clock['outputs_link_seconds_total'] / messages * 1e3:.2f}")
        return f"{clock['finished_request_seconds_total'] / requests * 1e3:.2f} ({'; '.join(parts)})"

    sweeps = []
    for f, clock in zip(seen, clocks):
        engines = ", ".join(f"{name} {in_engine(c)}" for name, c in clock.items() if c.get("finished_requests_total"))
        sweeps.append(f"prefill call {f['prefill_call_seconds_total']:.2f}, handover "
                      f"{f['decode_handover_seconds_total']:.2f}, decode call to its first output "
                      f"{f['decode_first_output_seconds_total']:.2f} and its last "
                      f"{f['decode_call_seconds_total']:.2f}; the frontends' loop {f['loop_ms']:.3f}; in the "
                      f"engines {engines}")
    return (f"a disaggregated request at c={concurrency} in the frontend, ms, first | second sweep (each engine: "
            f"from its inbox to the request's last output there; a loop: what a callback made ready waits, a "
            f"probe's mean): " + " | ".join(sweeps))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="tiny-disagg")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--output-spread", type=int, default=0,
                        help="each request's output tokens drawn from --output-tokens +- this: no closed-loop waves "
                             "(hpc bench's default is 0, equal requests)")
    # 128: on two H200 a c=64 level of 32 a user lasted 0.6 s, and its first and second sweeps differed by up to
    # 35 % (a level's start-up hiccups and the host's CPU speed weigh in a short level); at 128 (2 s), 7 of 10
    # pairs kept every level within 10 % (docs/performance-log.md, session 28)
    parser.add_argument("--requests-per-user", type=int, default=128,
                        help="requests per level, per unit of concurrency, at least (default 128; hpc bench's "
                             f"floor is {REQUESTS_PER_USER}); more makes each level longer and its figure less noisy")
    parser.add_argument("--min-requests", type=int, default=256,
                        help="requests per level at least, whatever the concurrency: with 32 a user the c=1 level "
                             "is 32 requests, a third of a second on a GPU, and its figure moves by a quarter")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--profile", metavar="DIR", help="after the sweeps, profile each component with py-spy "
                        "through a longer run at the highest concurrency (which functions hold each one's GIL)")
    parser.add_argument("--profile-seconds", type=int, default=3, help="how long each py-spy samples")
    parser.add_argument("--profile-native", action="store_true",
                        help="with --profile: C frames too (a wait for the GIL, a CUDA call), each sample pausing "
                             "the process")
    parser.add_argument("--client-processes", default="auto", metavar="N|auto",
                        help="the load generator's processes per level, as hpc bench's (default auto)")
    parser.add_argument("--pin-engines", nargs="?", const="last", metavar="CPUS",
                        help="an experiment: each engine's scheduler thread on a physical core of its own (the "
                             "last cores, or the given CPUs, one an engine in the workers' name order: "
                             "decode-0,prefill-0), everything else of the stack and the load generator on the "
                             "other cores")
    parser.add_argument("--hidden-siblings", action="store_true",
                        help="before the launch, time which CPUs slow each other down (cpu_siblings.py: a VM shows "
                             "one thread a core whatever the host does); --pin-engines then keeps an engine's "
                             "hidden sibling idle")
    add_set_option(parser)
    args = parser.parse_args()
    recipe, _ = load_recipe(args.recipe)

    def clients(level: Level) -> int:
        return processes_for(args.client_processes, level.concurrency, os.cpu_count() or 1)

    # requests per level as `hpc bench` sends them by default: the recipe's number, at least 4 per user
    levels = [Level(c, args.input_tokens, args.output_tokens,
                    max(recipe.benchmark.requests_per_level, args.requests_per_user * c, args.min_requests),
                    output_spread=args.output_spread)
              for c in (int(x) for x in args.concurrency.split(","))]
    batch = max(lv.concurrency for lv in levels)
    roles = [name for name in ("agg", "prefill", "decode") if getattr(recipe.roles, name) is not None]
    overrides = [f'roles.{r}.override_engine_args={{"max_batch_size": {batch}}}' for r in roles]

    async def sweeps(url: str, model: str, urls: dict[str, str],
                     leaders: dict[str, int]) -> tuple[list[dict[int, dict]], list[dict], list[dict[str, float]]]:
        """Two sweeps; each worker's SWEEP_COUNTERS over each; the cores each component kept busy in the
        highest level of each (CPU seconds / wall seconds: near 1 for one process is a GIL-bound one)."""
        out, spent, busy = [], [], []
        for sweep in range(2):  # no warm-up requests: the first sweep is what a user's first traffic sees
            before = {name: counters(u, SWEEP_COUNTERS) for name, u in urls.items()}
            results = {}
            taken = process_requests(url)  # then each level's end is the next one's start: only completions count
            for i, lv in enumerate(levels):
                if lv is levels[-1]:
                    cpu0, wall0 = {n: group_cpu_seconds(p) for n, p in leaders.items()}, time.perf_counter()
                    cpu0["client"] = time.process_time()  # this process: the load generator
                    machine0, threads0 = _cpu_topology.machine_ticks(), engine_threads(leaders)
                    seen0 = frontend_latency(url)
                clock0 = {name: counters(u, SCHEDULER_CLOCK) for name, u in urls.items()}
                began = time.time()  # wall clock: to line up with a GPU clock log (nvidia-smi -lms)
                # prompts of their own at each level and sweep: the second sweep must not find the first's in
                # the prefix cache (it did, with one seed for all, and was faster for it)
                results[lv.concurrency] = {**await run_level(url, model, lv, True, 0, seed=sweep * len(levels) + i,
                                                             processes=clients(lv)),
                                           "began_at": began, "ended_at": time.time()}
                taken0, taken = taken, process_requests(url)
                split.setdefault(lv.concurrency, []).append([b - a for a, b in zip(taken0, taken)])
                level_clocks.setdefault(lv.concurrency, []).append(
                    {name: clock_spent(clock0[name], counters(u, SCHEDULER_CLOCK)) for name, u in urls.items()})
            wall = time.perf_counter() - wall0
            contended.append(_cpu_topology.contention(machine0, _cpu_topology.machine_ticks(), threads0,
                                                      engine_threads(leaders), wall, schedulers=schedulers))
            seen = frontend_latency(url)
            frontend_seen.append({**{k: (seen[k] - seen0[k]) / max(seen["count"] - seen0["count"], 1) * 1e3
                                     for k in ("ttft", "e2e")},
                                  "gc_ms": (seen["gc"] - seen0["gc"]) * 1e3,
                                  "gc_full": seen["gc_full"] - seen0["gc_full"],
                                  "loop_ms": (seen["loop_s"] - seen0["loop_s"]) * 1e3
                                  / max(seen["loop_n"] - seen0["loop_n"], 1),
                                  **{k: (seen[k] - seen0[k]) / max(seen["disagg"] - seen0["disagg"], 1) * 1e3
                                     for k in DISAGG_PHASES}})
            client_cpu = time.process_time() - cpu0["client"] + results[levels[-1].concurrency].get("client_cpu_s", 0)
            busy.append({**{n: (group_cpu_seconds(p) - cpu0[n]) / wall for n, p in leaders.items()},
                         "client": client_cpu / wall})
            out.append(results)
            after = {name: counters(u, SWEEP_COUNTERS) for name, u in urls.items()}
            spent.append({name: {k: after[name][k] - before[name][k] for k in SWEEP_COUNTERS} for name in urls})
        if args.profile:
            await profiled_level(url, model, leaders)
        return out, spent, busy

    async def profiled_level(url: str, model: str, leaders: dict[str, int]) -> None:
        top = levels[-1]
        longer = dataclasses.replace(top, requests=top.requests * 8 * -(-args.profile_seconds // 3))
        load = asyncio.create_task(run_level(url, model, longer, True, 0, seed=2 * len(levels),
                                             processes=clients(top)))
        await asyncio.sleep(0.5)  # at full concurrency before sampling starts
        spies = _profile.record(leaders, args.profile_seconds, Path(args.profile), native=args.profile_native)
        await load
        for name, mode, path, spy in spies:
            _, err = await asyncio.to_thread(spy.communicate)
            profiles.setdefault(name, []).extend(_profile.summary(path, mode) if path.is_file()
                                                 else [f"  py-spy ({mode}) failed: {err.decode()[-300:]}"])

    if args.profile and not _profile.available():
        raise SystemExit("--profile needs py-spy on PATH (pip install py-spy)")
    profiles: dict[str, list[str]] = {}
    level_clocks: dict[int, list[dict[str, dict[str, float]]]] = {}  # per level, per sweep, per worker
    split: dict[int, list[list[float]]] = {}  # per level, per sweep: the requests each frontend process took
    frontend_seen: list[dict[str, float]] = []
    contended: list[str] = []  # the machine's and each engine's scheduler thread's CPU at the highest level

    def engine_threads(leaders: dict[str, int]) -> dict[str, dict[int, tuple]]:
        """Each worker's engine process's threads (the worker's own where its engine runs in it)."""
        return {name: _cpu_topology.threads((_cpu_topology.engine_pids(leader) or [leader])[0])
                for name, leader in leaders.items() if name.startswith(("agg", "prefill", "decode"))}
    found = _cpu_topology.cores()
    sibling_lines: list[str] = []
    if args.hidden_siblings:  # before anything of ours runs: the probe needs idle CPUs
        sibling_lines, pairs = cpu_siblings.probe(sorted(os.sched_getaffinity(0)))
        found = _cpu_topology.merge_siblings(found, pairs)
    with contextlib.redirect_stdout(io.StringIO()):
        stack = local_stack(args.recipe, *overrides, *args.overrides)
        run, url = stack.__enter__()
    frontends = run.manifest().plan.service("frontend").processes
    try:
        model = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=10).read())["data"][0]["id"]
        placed = workers(Path(run.path))
        urls = {name: state["http"] for name, state in placed.items() if state.get("http")}
        leaders = {name: pids[0] for name, pids in local_pids(run).items() if pids and name not in ("etcd", "nats")}
        topology = _cpu_topology.describe(_cpu_topology.cores())  # before any pinning narrows what we see
        # each engine's scheduler thread (OS id), as the engine says (absent from an engine without one)
        schedulers = {name: int(tid) for name, u in urls.items()
                      if (tid := counters(u, ("scheduler_thread_id",))["scheduler_thread_id"])}
        try:
            chosen = _cpu_topology.chosen_cpus(args.pin_engines)
            pinned = _cpu_topology.pin_engines(leaders, chosen, schedulers, found) if args.pin_engines else []
        except ValueError as exc:  # a bad list or too few cores: the caller's input, one line and exit 2
            print(f"stack_sweeps.py: --pin-engines {args.pin_engines}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        with ClockLog() as clocks, CpuSpeedLog() as cpu_speed:
            (first, second), spent, busy = asyncio.run(sweeps(url, model, urls, leaders))
        handoff = {name: counters(state["http"]) for name, state in placed.items()
                   if state.get("http") and name.startswith("prefill")}
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            stack.__exit__(None, None, None)
    print(f"{args.recipe}: " + ", ".join(f"{name} on {state['device']}" for name, state in placed.items())
          + f"; {frontends} frontend processes; {topology}")
    for line in sibling_lines:
        print(f"hidden siblings: {line}")
    for line in pinned:
        print(f"pinned: {line}")
    for name, stats in handoff.items():
        print(f"{name}: {int(stats.get('requests', 0))} prefills, {int(stats.get('kv_ipc_shared', 0))} KV handoffs "
              f"shared over CUDA IPC (the rest as bytes)")
    spread = [f"c={lv.concurrency}: {first[lv.concurrency].get('client_processes', 1)}" for lv in levels]
    print("client processes per level: " + ", ".join(spread))
    print(f"{'c':>4} {'requests':>9} {'peak':>5} {'first tok/s':>12} {'second tok/s':>13} {'first/second':>13} "
          f"{'p99 e2e s (1st)':>16} {'p50 TTFT / e2e ms (1st)':>24}")
    for lv in levels:
        a, b = first[lv.concurrency], second[lv.concurrency]
        print(f"{lv.concurrency:>4} {lv.requests:>9} {a['peak_inflight']:>5} {a['output_tokens_per_s']:>12.1f} "
              f"{b['output_tokens_per_s']:>13.1f} {a['output_tokens_per_s'] / b['output_tokens_per_s']:>13.0%} "
              f"{a['e2e_s']['p99']:>16.3f} {a['ttft_s']['p50'] * 1e3:>13.1f} / {a['e2e_s']['p50'] * 1e3:>8.1f}")
    if frontends > 1:  # uneven, one process's loop is busier and its requests slower
        print("requests each frontend process took, first | second sweep: " + ", ".join(
            f"c={c} " + " | ".join("/".join(f"{n:.0f}" for n in sweep) for sweep in split[c]) for c in split))

    def requests_ms(level: dict) -> str:
        return ", ".join(f"{r['ttft_s'] * 1e3:.1f} / {r['e2e_s'] * 1e3:.1f}" for r in level["first_requests"]
                         if r["ttft_s"] is not None)

    low = levels[0].concurrency
    print(f"first requests at c={low}, TTFT / e2e ms: first sweep {requests_ms(first[low])}; "
          f"second {requests_ms(second[low])}")
    print("each worker over the first / second sweep (seconds, or allocations opened over CUDA IPC):")
    for name in urls:
        a, b = spent[0][name], spent[1][name]
        print(f"  {name}: " + ", ".join(f"{k.removesuffix('_total')} {a[k]:.3g} / {b[k]:.3g}"
                                        for k in SWEEP_COUNTERS if a[k] or b[k]))

    def per_request(sweep: dict[str, float]) -> str:
        """Inside a worker's engine, per request: arrival to a slot, arrival to its first token (prefill); with
        the engine in a process of its own, before it: the link from the worker to that process's loop, the wait
        for the request's task there; then the submit (a decode's KV fetch) and the wait in the inbox."""
        def ms(name: str) -> float:
            return sweep[name] / max(sweep["requests"], 1) * 1e3

        first = sweep["first_token_seconds_total"] / sweep["first_tokens"] * 1e3 if sweep["first_tokens"] else None
        parts = [f"{label} {ms(name):.2f}" for label, name in (("link", "link_seconds_total"),
                                                               ("task start", "task_start_seconds_total"))
                 if sweep[name]]
        parts += [f"submit {ms('submit_seconds_total'):.2f}", f"inbox {ms('inbox_seconds_total'):.2f}"]
        return f"queue {ms('queue_seconds_total'):.2f} ms ({', '.join(parts)})" + (
            f", first token {first:.2f} ms" if first is not None else "")

    print("inside each engine per request, first / second sweep: " + "; ".join(
        f"{name} {per_request(spent[0][name])} / {per_request(spent[1][name])}" for name in urls))
    print("each engine's scheduler per step, first; second sweep: a decode step's ms (decode / admit / idle, and "
          "of idle its polls with rows running) and tokens, or a prefill worker's per prefill step (admit (launch, "
          "kv, pick, answers, store) / idle) and prompts")
    for name in urls:
        print(f"  {name}: " + " | ".join(f"c={lv.concurrency} " + "; ".join(per_step(sweep[name])
                                                                         for sweep in level_clocks[lv.concurrency])
                                      for lv in levels))
    print(f"the frontend's own mean TTFT / e2e at c={levels[-1].concurrency} (from a request's arrival there), first "
          f"/ second sweep: " + " / ".join(f"{f['ttft']:.1f} / {f['e2e']:.1f} ms" for f in frontend_seen)
          + "; its processes' garbage collections: " + " / ".join(f"{f['gc_ms']:.1f} ms ({f['gc_full']:.0f} full)"
                                                                  for f in frontend_seen))
    if any(f["prefill_call_seconds_total"] for f in frontend_seen):
        print(request_phases(levels[-1].concurrency, frontend_seen, level_clocks[levels[-1].concurrency]))
    print(f"cores busy at c={levels[-1].concurrency}, first / second sweep: "
          + ", ".join(f"{n} {busy[0][n]:.2f} / {busy[1][n]:.2f}" for n in busy[0]))
    print(f"CPU at c={levels[-1].concurrency}, first | second sweep: " + " | ".join(contended))
    spans = {f"c={lv.concurrency}": [(s[lv.concurrency]["began_at"], s[lv.concurrency]["ended_at"])
                                    for s in (first, second)] for lv in levels}
    print(clocks.report(spans))
    print(cpu_speed.report(spans))
    if speeds := scheduler_cpu_speed(level_clocks):
        print(speeds)
    lo, hi = levels[0].concurrency, levels[-1].concurrency
    scale = [s[hi]["output_tokens_per_s"] / s[lo]["output_tokens_per_s"] for s in (first, second)]
    print(f"c={hi} / c={lo}: first sweep {scale[0]:.1f}x, second {scale[1]:.1f}x")
    for name, lines in profiles.items():
        print(f"profile of {name} at c={hi} (py-spy, files in {args.profile}):", *lines, sep="\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"recipe": args.recipe, "workers": placed, "handoff": handoff,
                                               "first": first, "second": second, "per_sweep": spent,
                                               "cores_busy_at_highest": busy, "scheduler_per_level": level_clocks,
                                               "frontend_process_requests": split},
                                              indent=1, default=str))


if __name__ == "__main__":
    main()
