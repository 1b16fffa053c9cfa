"""End-to-end tokens/s through the frontend vs calling the torch engine directly (same model, same load).

    python benchmarks/e2e_throughput.py [--recipe tiny-agg|tiny-disagg] [--concurrency 1,8,32] [--output-tokens 64] [--rounds 3]
    python benchmarks/e2e_throughput.py --engine-only --concurrency 1,8,32,64   # e.g. on a GPU machine
    python benchmarks/e2e_throughput.py --engine-only --engine-args '{"cuda_graph_config": null}'  # eager decode
    python benchmarks/e2e_throughput.py --engine-only --engine-args '{"torch_compile_config": null}'  # eager prefill
    python benchmarks/e2e_throughput.py --concurrency 64 --output-spread 32   # lengths 32-96: no waves
    python benchmarks/e2e_throughput.py --recipe tiny-disagg --direct agg     # against one aggregated engine

A disaggregated recipe's direct path is, by default, its own prefill and decode engines driven in this process
on the devices the stack's workers get (_direct.DirectPair): what the stack itself costs; `--direct agg` compares
it with one aggregated engine instead, which also saves disaggregation's own hop.

Both paths are warm alike: the direct engine is opened once and kept (as the stack's worker is), and every level
of either path starts with the same warm-up requests. The direct engine's outputs are taken as a worker takes them
(`TorchEngine.stream`, since session 13; `generate` before, whose per-token queue bound it at c=64 on a GPU).
Stack mode alternates direct and stack rounds so machine noise hits both; goal: the stack keeps >= 95 % of the
engine's tokens/s at every level. `--engine-only` runs two sweeps on one freshly loaded engine and prints both:
the engine warms up before it says ready, so the first sweep should be as fast as the second. Each level sends
4 x concurrency requests (at least --requests; --requests-per-user 16 makes levels four times as long, and their
figures less noisy).
Both paths sample at temperature 1: what hpc bench's requests get from the frontend (OpenAI's default).
Under the table, where each path's time went at each level (session 20): a request's time on the engine alone and
the client's p50 TTFT / e2e through the stack, then the scheduler clock of the direct engine and of every engine of
the stack (from their /metrics): decode / admit / idle a step, tokens a step, prompts a prefill step, and a prompt's
wait for its first token (and, in an engine process, in its link before that).
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
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from _cpu_speed import CpuSpeedLog  # noqa: E402
from _direct import DirectPair, pair_devices  # noqa: E402
from _gpu_clocks import ClockLog  # noqa: E402
from _scheduler_clock import SCHEDULER_CLOCK, per_step, spent as clock_spent  # noqa: E402
from _stack import add_set_option, counters, workers  # noqa: E402
from stack_sweeps import frontend_latency  # noqa: E402
from hpc.bench.loadgen import REQUESTS_PER_USER, Level, prompt_ids  # noqa: E402
from hpc.engine_args.precedence import TORCH_ENGINE_DEFAULTS, deep_update  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402

WARMUP = 2


def level_request(level: Level, rng: random.Random) -> GenerateRequest:
    """One of a level's requests straight to an engine: the stack's client's prompt and output lengths."""
    return GenerateRequest(request_id="x", token_ids=prompt_ids(level.input_tokens, rng),
                           sampling=SamplingParams(max_tokens=level.max_tokens(rng), ignore_eos=True,
                                                   temperature=1.0))


async def engine_level(engine: TorchEngine, level: Level, rng: random.Random) -> float:
    """Tokens/s of one closed-loop level straight on the engine. Its outputs are taken as a worker takes them
    (`TorchEngine.stream`: a callback per decode step's batch; `generate`'s queue and generator resumption per
    token kept this process's event loop holding 85 % of the GIL samples at c=64 on an H200, the engine's thread
    14 %), and every request is made before the clock starts (the stack's client makes its own in processes of
    its own)."""
    async def one(req: GenerateRequest) -> int:
        produced = 0

        def deliver(out) -> None:
            nonlocal produced
            produced += len(out.token_ids)

        await engine.stream(req, deliver)
        return produced

    for _ in range(WARMUP):
        await one(level_request(level, rng))
    queue = [level_request(level, rng) for _ in range(level.requests)]
    tokens = 0

    async def user() -> None:
        nonlocal tokens
        while queue:
            produced = await one(queue.pop())  # not `tokens += await one()`: that reads `tokens` before the
            tokens += produced                 # await and drops what the other users added meanwhile (381 %)

    t0 = time.perf_counter()
    await asyncio.gather(*[user() for _ in range(level.concurrency)])
    return tokens / (time.perf_counter() - t0)


def direct_engine_args(input_tokens: int, output_tokens: int, spread: int, batch: int,
                       extra: dict[str, Any]) -> dict[str, Any]:
    """What the stack's torch workers get too: the recipe's defaults for the engine, room for the longest
    request, a batch for the highest level, then the caller's --engine-args."""
    return deep_update(TORCH_ENGINE_DEFAULTS, {"max_seq_len": input_tokens + output_tokens + spread + 64,
                                               "max_batch_size": batch, **extra})


def quiet_recipe(recipe_name: str) -> Any:
    """The recipe, loaded without the loader's printed notes (they would interleave with the table)."""
    from hpc.spec.catalog import load_recipe

    with contextlib.redirect_stdout(io.StringIO()):
        recipe, _ = load_recipe(recipe_name)
    return recipe


def direct_model(recipe: Any, named: str | None) -> tuple[str, str]:
    """(the generated model's kind, its directory) for the direct path: the recipe's own (the directory the
    stack's workers load) unless `named` (--model) is another kind, built in the models cache."""
    model = named or recipe.model.generate or "tiny"
    return model, recipe.model.path if model == recipe.model.generate else f"~/.cache/hpc/models/{model}"


def recipe_role_args(recipe: Any) -> dict[str, Any]:
    """The override_engine_args of the recipe's decode (or aggregated) role, less its batch and cache length,
    which the levels set for both paths."""
    role = recipe.roles.decode or recipe.roles.agg
    return {k: v for k, v in (role.override_engine_args or {}).items() if k not in ("max_batch_size", "max_seq_len")}


def stack_max_seq_len(recipe: Any) -> int:
    """The max_seq_len the recipe's workers get (hpc.engine_args.precedence.recipe_defaults: its limits)."""
    return recipe.limits.max_input_tokens + recipe.limits.max_output_tokens


def direct_engine(model_dir: Any, engine_args: dict[str, Any], pair: bool) -> Any:
    """The direct path, opened with `async with`: one aggregated engine, or a prefill and a decode engine placed
    as the local launch places the stack's workers."""
    if not pair:
        return TorchEngine(model_dir, DisaggregationMode.AGGREGATED, engine_args)
    import torch

    return DirectPair(model_dir, engine_args, pair_devices(torch.cuda.device_count()))


def pin_schedulers(engine: Any, stack_run: Any, setting: str) -> list[str]:
    """--pin-schedulers: the scheduler threads of the direct path's decode (or only) engine and of the stack's
    decode or aggregated engines on one physical core, the prefill engines' on another (the two paths alternate:
    each level runs on the same CPUs either way), every other thread of this process and of the stack elsewhere."""
    import _cpu_topology

    from hpc.launch.local import local_pids

    direct = {"prefill": engine.prefill, "decode": engine.decode} if isinstance(engine, DirectPair) \
        else {"decode": engine}
    groups: dict[str, list[int]] = {}
    for role, one in direct.items():
        groups.setdefault(role, []).append(int(one.stats()["scheduler_thread_id"]))
    for name, state in workers(Path(stack_run.path)).items():
        if state.get("http"):
            role = "prefill" if name.startswith("prefill") else "decode"
            groups.setdefault(role, []).append(int(counters(state["http"], ("scheduler_thread_id",))[
                "scheduler_thread_id"]))
    roles = sorted(groups, key=lambda role: role != "decode")  # the decode engines' core first
    stack = [pid for leaders in local_pids(stack_run).values() for leader in leaders
             for pid in _cpu_topology.group(leader)]
    try:
        pinned, rest = _cpu_topology.pin_threads([groups[role] for role in roles], stack,
                                                 _cpu_topology.chosen_cpus(setting))
    except ValueError as exc:  # a bad list or too few cores: the caller's input, one line and exit 2
        print(f"e2e_throughput.py: --pin-schedulers {setting}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    shown = {"decode": "decode" if "prefill" in groups else "aggregated", "prefill": "prefill"}
    return [f"the {shown[role]} engines' scheduler threads {groups[role]} on CPUs {sorted(cpus)}"
            for role, cpus in zip(roles, pinned)] + [f"everything else on the other {len(rest)} CPUs"]


def device_label(engine: Any) -> str:
    import torch

    if isinstance(engine, DirectPair):  # prefill and decode engines, on their devices
        where = f"{engine.prefill.device} + {engine.decode.device}" if engine.prefill.device.type == "cuda" else ""
        return f"{device_label(engine.decode)}, prefill and decode engines{' on ' + where if where else ''}"
    if engine.device.type == "cuda":
        return f"{torch.cuda.get_device_name(engine.device)} ({engine.core.dtype})".replace("torch.", "")
    return f"CPU, {os.cpu_count()} cores ({engine.core.dtype})".replace("torch.", "")


def stack_levels(direct: dict[int, list[float]], via: dict[int, list[float]],
                 clocks: dict[int, dict[str, dict[str, float]]] | None = None,
                 client_e2e: dict[int, list[float]] | None = None) -> dict[int, dict[str, Any]]:
    """Each level's rounds on both paths and the stack's share of the engine: the medians' ratio, as the table's.

    With `clocks` (level -> engine, the direct path's as "directly" -> its scheduler clock over the rounds), what
    bounds that share in a closed loop, where a user is out of the engine while its request crosses the stack's
    hops: each decoding engine's tokens a decode step (how full its batches ran; where a step's time hardly
    depends on its rows, as the tiny model's GEMVs', the stack keeps about the share of the engine's tokens a
    step that its batches held), and with `client_e2e` (each round's mean seconds a request at the client) the
    share of a request's time that it spent inside the stack's engines, from each one's inbox to its answer."""
    levels: dict[int, dict[str, Any]] = {}
    for c in direct:
        level: dict[str, Any] = {"engine_tok_s": direct[c], "stack_tok_s": via[c],
                                 "kept": statistics.median(via[c]) / statistics.median(direct[c])}
        engines = (clocks or {}).get(c, {})
        full = {name: clock["generated_tokens"] / clock["decode_steps"]
                for name, clock in engines.items() if clock.get("decode_steps")}
        if full:
            level["tokens_a_step"] = full
        inside = sum(clock["finished_request_seconds_total"] / clock["finished_requests_total"]
                     for name, clock in engines.items() if name != "directly" and clock.get("finished_requests_total"))
        if inside and (client_e2e or {}).get(c):
            level["in_engines"] = inside / statistics.mean(client_e2e[c])
        levels[c] = level
    return levels


def write_json(path: str | None, figures: dict[str, Any]) -> None:
    """The run's figures, each level's under its concurrency (gpu_suite.py's goals read them)."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="8", help="levels, e.g. 1,8,32,64")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least 4 x concurrency)")
    parser.add_argument("--requests-per-user", type=int, default=REQUESTS_PER_USER,
                        help=f"each level sends at least this many requests per user (default {REQUESTS_PER_USER}); "
                             "more makes each level longer and its figure less noisy")
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    parser.add_argument("--engine-only", action="store_true", help="sweeps on the engine, no stack")
    parser.add_argument("--sweeps", type=int, default=2, help="with --engine-only: sweeps back to back (2 or more: "
                                                              "the first is set against the later ones)")
    parser.add_argument("--model", default=None,
                        help="the generated model to serve (default: the recipe's, e.g. tiny, llama-8b-shape)")
    parser.add_argument("--recipe", default="tiny-agg", help="the stack to compare with (tiny-agg, tiny-disagg)")
    parser.add_argument("--pin-schedulers", nargs="?", const="last", metavar="CPUS",
                        help="against the VM's uneven vCPUs: the direct path's engine and the stack's take turns "
                             "on one physical core (the last, or the given CPU's), their schedulers' threads "
                             "alone there; a prefill engine's on a second; everything else on the other cores")
    add_set_option(parser)
    parser.add_argument("--client-in-process", action="store_true",
                        help="the stack's load generator in this process, beside the engine (before 2026-11-25); "
                             "by default it has a process of its own, as hpc bench does")
    parser.add_argument("--client-processes", default="auto", metavar="N|auto",
                        help="the stack's load generator: processes per level (default auto, as hpc bench's: one "
                             "per 16 users); 1 keeps one process of its own, as before 2026-11-26")
    parser.add_argument("--engine-args", default="{}", help="JSON merged into the engine args of both paths")
    parser.add_argument("--output-spread", type=int, default=0,
                        help="each request's output length uniform in output-tokens +- this (0: all equal)")
    parser.add_argument("--direct", choices=("auto", "agg", "disagg"), default="auto",
                        help="the direct path: one aggregated engine, or a prefill and a decode engine in this "
                             "process on the devices the stack's workers get (_direct.DirectPair); auto: the "
                             "recipe's shape")
    parser.add_argument("--json", help="also write each level's tokens/s (and the stack's share) here")
    args = parser.parse_args()
    if args.engine_only and args.sweeps < 2:
        parser.error(f"--sweeps {args.sweeps}: at least 2, as the first sweep is compared with the later ones")
    levels = [Level(c, args.input_tokens, args.output_tokens, max(args.requests, args.requests_per_user * c),
                    output_spread=args.output_spread) for c in (int(x) for x in args.concurrency.split(","))]
    recipe = quiet_recipe(args.recipe)
    model, model_path = direct_model(recipe, args.model)
    model_dir = ensure_model(model_path, model)
    served = recipe.model.served_name
    # the recipe's engine args for its serving role (the 8B shape's bf16), under the caller's --engine-args
    extra = deep_update(recipe_role_args(recipe), json.loads(args.engine_args))
    if not args.engine_only and "max_seq_len" not in extra:
        # the stack's workers' own (the recipe's limits): the decode attention's launch covers the whole cache
        # length, so a direct engine of a shorter cache stepped faster than any worker could (192 against 768)
        extra["max_seq_len"] = stack_max_seq_len(recipe)
    engine_args = direct_engine_args(args.input_tokens, args.output_tokens, args.output_spread,
                                     max(lv.concurrency for lv in levels), extra)
    pair = args.direct == "disagg" or (args.direct == "auto" and not args.engine_only and recipe.disaggregated)

    async def run() -> tuple[str, dict[int, list[float]], dict[int, list[float]], int]:
        """(device, engine tok/s per level, stack tok/s per level, the stack's frontend processes)."""
        direct: dict[int, list[float]] = {lv.concurrency: [] for lv in levels}
        via: dict[int, list[float]] = {lv.concurrency: [] for lv in levels}
        t0 = time.perf_counter()
        async with direct_engine(model_dir, engine_args, pair) as engine:
            print(f"engine loaded and warmed up in {time.perf_counter() - t0:.1f} s "
                  f"(warm-up {engine.warmup_s:.2f} s)", file=sys.stderr)
            rng = random.Random(0)
            if args.engine_only:  # direct: the first sweep; via: the later ones
                for sweep in [direct] + [via] * (args.sweeps - 1):
                    for lv in levels:
                        began, before = time.time(), engine.stats()
                        sweep[lv.concurrency].append(await engine_level(engine, lv, rng))
                        spans.setdefault(f"c={lv.concurrency}", []).append((began, time.time()))
                        after = engine.stats()
                        spent.setdefault(lv.concurrency, []).append(clock_spent(before, after))
                return device_label(engine), direct, via, 0
            from _stack import local_stack
            from hpc.bench.clients import processes_for, run_apart
            from hpc.bench.clients import run_level

            with contextlib.redirect_stdout(io.StringIO()):
                override = json.dumps({k: v for k, v in engine_args.items() if k != "max_seq_len"})
                roles = [role for role in ("agg", "prefill", "decode") if getattr(recipe.roles, role) is not None]
                stack = local_stack(args.recipe, *(f"roles.{role}.override_engine_args={override}" for role in roles),
                                    *args.overrides)
                stack_run, url = stack.__enter__()
            print(f"stack launched in {time.perf_counter() - t0:.1f} s since the start", file=sys.stderr, flush=True)
            frontends = stack_run.manifest().plan.service("frontend").processes
            try:
                if args.pin_schedulers:  # the stack stopped below whatever this raises
                    for line in pin_schedulers(engine, stack_run, args.pin_schedulers):
                        print(line, file=sys.stderr)
                placed = {name: state["http"] for name, state in workers(Path(stack_run.path)).items()
                          if state.get("http")}
                for round_ in range(args.rounds):
                    for i, lv in enumerate(levels):
                        before, began = engine.stats(), time.time()
                        direct[lv.concurrency].append(await engine_level(engine, lv, rng))
                        spans.setdefault(f"c={lv.concurrency} directly", []).append((began, time.time()))
                        add_clock(lv.concurrency, "directly", clock_spent(before, engine.stats()))
                        before = {name: counters(u, SCHEDULER_CLOCK) for name, u in placed.items()}
                        # prompts of its own each round and level, as the engine's (rng goes on): a round that
                        # repeated the last round's would find them in the workers' prefix cache
                        seed, began = round_ * len(levels) + i, time.time()
                        own = frontend_latency(url)
                        if args.client_in_process:
                            res = await run_level(url, served, lv, True, WARMUP, seed=seed)
                        else:  # apart from the engine's process, one client process per 16 users (hpc bench's auto)
                            processes = processes_for(args.client_processes, lv.concurrency, os.cpu_count() or 1)
                            res = await run_apart(url, served, lv, True, WARMUP, seed, processes)
                        via[lv.concurrency].append(res["output_tokens_per_s"])
                        spans.setdefault(f"c={lv.concurrency} stack", []).append((began, time.time()))
                        for name, u in placed.items():
                            add_clock(lv.concurrency, name, clock_spent(before[name], counters(u, SCHEDULER_CLOCK)))
                        seen.setdefault(lv.concurrency, []).append((res["ttft_s"]["p50"], res["e2e_s"]["p50"]))
                        client_e2e.setdefault(lv.concurrency, []).append(res["e2e_s"]["mean"])
                        after = frontend_latency(url)
                        summed = frontend_own.setdefault(lv.concurrency, dict.fromkeys(("ttft", "e2e", "count"), 0.0))
                        for key in summed:
                            summed[key] += after[key] - own[key]
                        # as it goes, for a run cut short (a GPU call's time limit): the table comes at the end
                        print(f"round {round_ + 1} c={lv.concurrency}: {direct[lv.concurrency][-1]:.1f} tok/s "
                              f"directly, {via[lv.concurrency][-1]:.1f} through the frontend", file=sys.stderr,
                              flush=True)
            finally:
                with contextlib.redirect_stdout(io.StringIO()):
                    stack.__exit__(None, None, None)
            return device_label(engine), direct, via, frontends

    # the stack's levels: each engine's scheduler clock summed over the rounds, keyed by level then engine (the
    # direct path's as "directly"), and the client's p50 TTFT and e2e seconds each round
    clocks_by_level: dict[int, dict[str, dict[str, float]]] = {}
    seen: dict[int, list[tuple[float, float]]] = {}
    client_e2e: dict[int, list[float]] = {}  # each round's mean seconds a request at the client
    # the frontend's own TTFT and e2e sums over each level's rounds, from a request's arrival there (its /metrics;
    # the client processes' warm-up requests are in them too, WARMUP each): against the client's, what the client's
    # side of the HTTP hop took; against the engine's first token, the frontend -> worker -> engine path
    frontend_own: dict[int, dict[str, float]] = {}

    def add_clock(level: int, name: str, clock: dict[str, float]) -> None:
        summed = clocks_by_level.setdefault(level, {}).setdefault(name, dict.fromkeys(clock, 0.0))
        for k, v in clock.items():
            summed[k] += v

    # each level's wall-time span, per sweep (--engine-only), or per round of each path
    spans: dict[str, list[tuple[float, float]]] = {}
    spent: dict[int, list[dict[str, float]]] = {}  # the scheduler's clock over each level, per sweep
    # the GPU clocks are reported for the engine-only sweeps alone: nothing samples them otherwise
    with ClockLog() if args.engine_only else contextlib.nullcontext() as clocks, CpuSpeedLog() as cpu_speed:
        label, direct, via, frontends = asyncio.run(run())
    lv0 = levels[0]
    out = f"{lv0.output_tokens} +- {args.output_spread}" if args.output_spread else str(lv0.output_tokens)
    print(f"tokens/s, {model} torch model on {label}, {lv0.input_tokens} in / {out} out, "
          f"{'' if args.engine_only else f'stack {args.recipe} ({frontends} frontend processes), '}"
          f"{f'{args.sweeps} sweeps' if args.engine_only else f'{args.rounds} alternating rounds, medians'}, "
          f"max_seq_len {engine_args['max_seq_len']}"
          f"{', engine args ' + args.engine_args if args.engine_args != '{}' else ''}")
    if args.engine_only:
        print(f"{'c':>4} {'requests':>9} {'first sweep':>12} {'second sweep':>13} {'first/second':>13}"
              f"{' later sweeps' if args.sweeps > 2 else ''}")
        for lv in levels:
            first, (second, *later) = direct[lv.concurrency][0], via[lv.concurrency]
            print(f"{lv.concurrency:>4} {lv.requests:>9} {first:>12.1f} {second:>13.1f} {first / second:>13.0%}"
                  f"{''.join(f' {x:.1f}' for x in later)}")
        print(clocks.report(spans))
        print(cpu_speed.report(spans))
        print("the scheduler per decode step, ms (decode / admit / idle, and of idle its polls with rows running), "
              "and tokens a step, in each sweep:")
        for lv in levels:
            print(f"  c={lv.concurrency}: " + "; ".join(per_step(s) for s in spent[lv.concurrency]))
        write_json(args.json, {"device": label, "engine_only": True, "levels": {
            lv.concurrency: {"first_tok_s": direct[lv.concurrency][0], "later_tok_s": via[lv.concurrency]}
            for lv in levels}})
        return
    print("the direct path: " + ("a prefill and a decode engine (the KV handed over as a tensor)" if pair
                                 else "one aggregated engine"))
    print(f"{'c':>4} {'requests':>9} {'engine directly':>16} {'through frontend':>17} {'kept':>6}  each round's kept")
    for lv in levels:
        d, v = statistics.median(direct[lv.concurrency]), statistics.median(via[lv.concurrency])
        rounds = " ".join(f"{b / a:.0%}" for a, b in zip(direct[lv.concurrency], via[lv.concurrency]))
        print(f"{lv.concurrency:>4} {lv.requests:>9} {d:>16.1f} {v:>17.1f} {v / d:>6.0%}  {rounds}")
    write_json(args.json, {"device": label, "recipe": args.recipe, "direct": "pair" if pair else "one engine",
                           "output_spread": args.output_spread,
                           "levels": stack_levels(direct, via, clocks_by_level, client_e2e)})
    print(cpu_speed.report(spans))  # a round whose paths ran on CPUs of different speeds is not a fair one
    print("where each path's time went, all rounds: a request's ms (directly: concurrency x output tokens / tokens/s;"
          " through the frontend: the client's p50 TTFT / e2e, and the frontend's own means from a request's arrival"
          " there), then each engine's scheduler per decode step, ms"
          " (decode / admit / idle, and of idle its polls with rows running), and tokens a step")
    for lv in levels:
        d = statistics.median(direct[lv.concurrency])
        ttft, e2e = (statistics.median(x) * 1e3 for x in zip(*seen[lv.concurrency]))
        own = frontend_own.get(lv.concurrency, {})
        inside = ""
        if own.get("count"):
            inside = f" (the frontend's own {own['ttft'] / own['count'] * 1e3:.2f} / " \
                     f"{own['e2e'] / own['count'] * 1e3:.2f})"
        print(f"  c={lv.concurrency}: request {lv.concurrency * lv.output_tokens / d * 1e3:.2f} directly, "
              f"{ttft:.2f} / {e2e:.2f} through the frontend{inside}")
        for name, clock in clocks_by_level[lv.concurrency].items():
            print(f"    {name}: {per_step(clock)}")


if __name__ == "__main__":
    main()
