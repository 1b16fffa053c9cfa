"""Where the torch engine's scheduler thread spends a closed-loop level: prefill, decode, picking, the rest.

    python benchmarks/engine_steps.py --concurrency 64 --output-spread 32   # sustained load (no waves)
    python benchmarks/engine_steps.py --concurrency 64                      # lock-step waves
    python benchmarks/engine_steps.py --engine-args '{"torch_compile_config": null}'   # eager prefill

The scheduler's methods are wrapped with wall-clock timers (host time: a CUDA step returns once launched, so
the wait for the GPU shows up in whatever reads its result first — picking the tokens). One level after a
warm-up level; the table gives each phase's total, its share of the level and its time per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_capacity import engine_line  # noqa: E402
from e2e_throughput import device_label, direct_engine_args, engine_level, level_request  # noqa: E402

from hpc.bench.loadgen import Level  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode  # noqa: E402


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1
        setattr(owner, name, timed)


async def prefill_level(engine: TorchEngine, level: Level, rng: random.Random) -> float:
    """Prompts/s of a closed loop of `level.concurrency` users on a prefill engine, each answer's KV released as
    it comes (a decode engine would take it)."""
    from hpc.runtime.serve.wire import replace

    requests = [replace(level_request(level, rng), streaming=False) for _ in range(level.requests)]
    total = len(requests)

    async def user() -> None:
        while requests:
            answers: list = []
            await engine.stream(requests.pop(), answers.append)
            engine.release_handoff(answers[-1].disaggregated_params.request_handle)

    t0 = time.perf_counter()
    await asyncio.gather(*[user() for _ in range(level.concurrency)])
    return total / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--output-spread", type=int, default=32)
    parser.add_argument("--engine-args", default="{}")
    parser.add_argument("--role", choices=("agg", "prefill"), default="agg",
                        help="prefill: a prefill worker's engine, each prompt answered with its KV kept for a "
                             "decode engine (released at once here); its figure is prompts/s")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests in each of the two levels (default 4 x concurrency); more for a profiler")
    args = parser.parse_args()
    level = Level(args.concurrency, args.input_tokens, args.output_tokens, args.requests or 4 * args.concurrency,
                  output_spread=args.output_spread)
    engine_args = direct_engine_args(args.input_tokens, args.output_tokens, args.output_spread, args.concurrency,
                                     json.loads(args.engine_args))
    timers = Timers()

    async def run() -> tuple[str, float, float, dict]:
        mode = DisaggregationMode.PREFILL if args.role == "prefill" else DisaggregationMode.AGGREGATED
        async with TorchEngine(ensure_model(f"~/.cache/hpc/models/{args.model}", args.model), mode,
                               engine_args) as engine:
            # the outer calls first: inner timers are then part of their callers' time
            timers.wrap(engine, "_admit", "admit (slots, prefix cache)")
            timers.wrap(engine, "_context_step", "prefill (incl. below)")
            timers.wrap(engine, "_decode_step", "decode step (incl. below)")
            timers.wrap(engine.core.picker, "pick_rows", "  pick tokens (waits for the GPU)")
            for graphs, method, label in ((engine.core.graphs, "run_picking", "  decode graph launch"),
                                          (engine.core.prefill_graphs, "run", "  prefill graph launch")):
                if graphs is not None:
                    timers.wrap(graphs, method, label)
            timers.wrap(engine.decode._host_copies, "start", "  decode tokens' copy to the host")
            timers.wrap(engine, "_padded_prefill", "  eager prefill")
            timers.wrap(engine.core.picker, "pick_on_device", "  first tokens picked on the device")
            timers.wrap(engine, "_store_prompts", "  prompts into the prefix cache")
            if engine.core.prefix is not None:
                timers.wrap(engine.core.prefix, "_stored", "    their KV event records")
                timers.wrap(engine.core.prefix, "_copy_in", "    their KV's copy into the pool")
            timers.wrap(engine, "_emit_inflight", "  emit a step's tokens")
            timers.wrap(engine, "_keep_for_handoff", "  KV kept for the decode engine")
            timers.wrap(engine, "_hand_over", "  answers (first token, KV handle)")
            rng = random.Random(0)
            run_level = prefill_level if args.role == "prefill" else engine_level
            await run_level(engine, level, rng)  # warm: the level's shapes and the loop's caches
            before = engine.stats()
            timers.on = True
            t0 = time.perf_counter()
            tok_s = await run_level(engine, level, rng)
            wall = time.perf_counter() - t0
            timers.on = False
            after = engine.stats()
            steps = {k: after[k] - before[k] for k in ("decode_steps", "prefill_steps", "prefill_steps_graphed",
                                                       "decode_steps_graphed") if k in after}
            print(f"engine counters (as client_capacity.py reads a worker's): {engine_line(before, after, wall)}")
            return device_label(engine), tok_s, wall, steps

    label, tok_s, wall, steps = asyncio.run(run())
    print(f"scheduler time, {args.model} on {label}, c={args.concurrency}, {args.input_tokens} in / "
          f"{args.output_tokens} +- {args.output_spread} out, {level.requests} requests: {tok_s:.0f} "
          f"{'prompts' if args.role == 'prefill' else 'tok'}/s, "
          f"{wall * 1e3:.0f} ms; steps {steps}")
    print(f"{'phase':<36} {'ms':>8} {'share':>6} {'calls':>6} {'us/call':>8}")
    for label_, seconds in timers.seconds.items():
        calls = timers.calls[label_]
        print(f"{label_:<36} {seconds * 1e3:>8.1f} {seconds / wall:>6.0%} {calls:>6} {seconds / calls * 1e6:>8.0f}")
    busy = sum(timers.seconds.get(label_, 0) for label_ in ("admit (slots, prefix cache)", "prefill (incl. below)",
                                                            "decode step (incl. below)"))
    print(f"{'rest (inbox, bookkeeping, event loop)':<36} {(wall - busy) * 1e3:>8.1f} {(wall - busy) / wall:>6.0%}")


if __name__ == "__main__":
    main()
