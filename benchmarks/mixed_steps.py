"""Mixed steps against prefill passes apart, whole prompts against chunked ones, at a served shape's load.

    python benchmarks/mixed_steps.py                                    # tiny-agg's model, CPU or the GPU here
    python benchmarks/mixed_steps.py --recipe llama8b-agg --input-tokens 1024 --output-tokens 128 --concurrency 8,32

The engine alone (as e2e_throughput.py --engine-only drives it: TorchEngine.stream, a closed loop of `concurrency`
users, each sending --requests-per-user requests in turn, temperature 1), with the recipe's engine args, once per
configuration: the prefill pass apart from the decode step (torch_engine.mixed_steps false, the engine before
session 47) and mixed (the default), each with whole prompts and with enable_chunked_prefill at each of
--budgets (max_num_tokens). Per configuration and level: output tokens/s, the first token's time at the client
(p50 / p90), and what the scheduler ran (mixed steps and plain decode steps, prompt tokens a mixed step). One
engine at a time, warmed by a level first; --rounds levels each, medians shown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_throughput import (device_label, direct_engine_args, direct_model, level_request, quiet_recipe,  # noqa: E402
                            recipe_role_args)

from hpc.bench.loadgen import Level  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode  # noqa: E402
from hpc.spec.recipe import TorchEngineSpec  # noqa: E402


async def closed_loop(engine: TorchEngine, level: Level, rng: random.Random) -> dict[str, Any]:
    """One level: output tokens/s over the level's wall time and each request's first-token seconds."""
    queue = [level_request(level, rng) for _ in range(level.requests)]
    first: list[float] = []
    tokens = 0

    async def user() -> None:
        nonlocal tokens
        while queue:
            request, sent, seen = queue.pop(), time.perf_counter(), [0]

            def deliver(out, sent=sent, seen=seen) -> None:
                if not seen[0] and out.token_ids:
                    first.append(time.perf_counter() - sent)
                seen[0] += len(out.token_ids)

            await engine.stream(request, deliver)
            tokens += seen[0]

    t0 = time.perf_counter()
    await asyncio.gather(*[user() for _ in range(level.concurrency)])
    wall = time.perf_counter() - t0
    first.sort()
    return {"tok_s": tokens / wall, "ttft_p50": first[len(first) // 2], "ttft_p90": first[int(len(first) * 0.9)]}


def steps_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    got = {k: after.get(k, 0) - before.get(k, 0) for k in ("mixed_steps", "decode_steps", "mixed_prompt_tokens",
                                                            "prefill_steps")}
    return {"mixed_steps": got["mixed_steps"], "plain_decode_steps": got["decode_steps"] - got["mixed_steps"],
            "prefill_passes_apart": got["prefill_steps"] - got["mixed_steps"],
            "prompt_tokens_a_mixed_step": got["mixed_prompt_tokens"] / got["mixed_steps"] if got["mixed_steps"]
            else 0.0}


async def configuration(model_dir: str, engine_args: dict[str, Any], mixed: bool, levels: list[Level],
                        rounds: int) -> tuple[str, dict[int, dict[str, Any]]]:
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, engine_args,
                           switches=TorchEngineSpec(mixed_steps=mixed)) as engine:
        rng, results = random.Random(3), {}
        for level in levels:
            await closed_loop(engine, level, rng)  # warm: the level's shapes
            before = engine.stats()
            runs = [await closed_loop(engine, level, rng) for _ in range(rounds)]
            results[level.concurrency] = {
                **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
                **{k: v / rounds for k, v in steps_since(before, engine.stats()).items()}}
        return device_label(engine), results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="tiny-agg")
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="8", help="levels, e.g. 8,32")
    parser.add_argument("--requests-per-user", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-spread", type=int, default=0,
                        help="each request's output length drawn from output-tokens +- this (no waves)")
    parser.add_argument("--budgets", default="2048,1024,512", help="max_num_tokens of the chunked configurations")
    parser.add_argument("--apart", choices=("all", "whole", "none"), default="all",
                        help="which configurations also run with the prefill pass apart")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    try:
        levels = [Level(concurrency=int(c), input_tokens=args.input_tokens, output_tokens=args.output_tokens,
                        requests=int(c) * args.requests_per_user, output_spread=args.output_spread) for c in args.concurrency.split(",")]
        budgets = [int(b) for b in args.budgets.split(",") if b]
    except ValueError as exc:
        parser.error(f"--concurrency and --budgets take comma-separated integers ({exc})")
    if any(level.concurrency < 1 for level in levels) or any(b < 64 for b in budgets) or args.rounds < 1:
        parser.error("--concurrency, --rounds at least 1 and --budgets at least 64")
    recipe = quiet_recipe(args.recipe)
    kind, path = direct_model(recipe, None)
    model_dir = str(ensure_model(path, kind))
    base = direct_engine_args(args.input_tokens, args.output_tokens, args.output_spread, max(level.concurrency for level in levels),
                              recipe_role_args(recipe))
    prompts = [("whole", {})] + [(f"chunked {b}", {"enable_chunked_prefill": True, "max_num_tokens": b})
                                 for b in budgets]
    configs = [(f"{name}, mixed", extra, True) for name, extra in prompts]
    if args.apart != "none":
        configs += [(f"{name}, apart", extra, False) for name, extra in prompts[:1 if args.apart == "whole" else None]]
    figures: dict[str, Any] = {"recipe": args.recipe, "model": kind, "input_tokens": args.input_tokens,
                               "output_tokens": args.output_tokens, "configurations": {}}
    for name, extra, mixed in configs:
        label, results = asyncio.run(configuration(model_dir, {**base, **extra}, mixed, levels, args.rounds))
        figures["device"] = label
        figures["configurations"][name] = results
    print(f"{kind} on {figures['device']}: {args.input_tokens} in / {args.output_tokens} out, closed loop, "
          f"{args.rounds} rounds (medians)")
    print(f"{'configuration':<22} {'c':>3} {'tok/s':>7} {'TTFT p50':>9} {'p90 ms':>7} {'mixed':>6} {'decode':>7} "
          f"{'apart':>6} {'prompt/mixed':>12}")
    for name, results in figures["configurations"].items():
        for c, r in results.items():
            print(f"{name:<22} {c:>3} {r['tok_s']:>7.0f} {r['ttft_p50'] * 1e3:>9.1f} {r['ttft_p90'] * 1e3:>7.1f} "
                  f"{r['mixed_steps']:>6.0f} {r['plain_decode_steps']:>7.0f} {r['prefill_passes_apart']:>6.0f} "
                  f"{r['prompt_tokens_a_mixed_step']:>12.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
