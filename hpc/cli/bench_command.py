"""`hpc bench RUN | --url URL`: load sweeps with a validity gate; `hpc bench --compare A B`."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc.cli.args import bounded_int


MAX_LIST_VALUES = 64  # levels of a sweep, TP sizes of a profile: each one is a measurement to wait for
MAX_LIST_VALUE = 1_000_000  # concurrency, lengths, TP: far past any real one, short of a MemoryError


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of whole numbers from 1 to MAX_LIST_VALUE, at most MAX_LIST_VALUES of them."""
    items = text.split(",")
    if len(items) > MAX_LIST_VALUES:
        raise argparse.ArgumentTypeError(f"{len(items)} values; at most {MAX_LIST_VALUES}")
    if any(not item.strip() for item in items):
        raise argparse.ArgumentTypeError(f"an empty value in {text[:40]!r}: write e.g. 1,4,16")
    try:
        values = [int(v) for v in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text[:40]!r}") from None
    if not all(1 <= v <= MAX_LIST_VALUE for v in values):
        raise argparse.ArgumentTypeError(f"values must be from 1 to {MAX_LIST_VALUE:,}")
    return values


def rate(text: str) -> float:
    """Requests per second: finite and above 0 (nan and inf are floats too)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests/s, got {text[:40]!r}") from None
    if not 0 < value <= 1e6:  # false for nan
        raise argparse.ArgumentTypeError("must be above 0 and at most 1,000,000 requests/s")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load sweep (TTFT, ITL, latency, throughput) with a validity gate")
    p.add_argument("run", nargs="?", help="run directory, run id or job id (uses its frontend and recipe)")
    p.add_argument("--url", help="any OpenAI-compatible base URL instead of a run, e.g. http://host:8000")
    p.add_argument("--model", help="model name (default: the run's served name)")
    p.add_argument("--concurrency", type=positive_ints, help="e.g. 1,4,16 (default: the recipe's)")
    p.add_argument("--input-tokens", type=positive_ints, help="input lengths, e.g. 128,1024")
    p.add_argument("--output-tokens", type=positive_ints, help="output lengths (paired with --input-tokens)")
    p.add_argument("--requests", type=bounded_int(1, 100_000_000), help="requests per level (default: the recipe's, at least 4 x concurrency)")
    p.add_argument("--requests-per-user", type=int, metavar="N",
                   help="requests per level at least N x concurrency (default 4; the recipe's number if larger). "
                        "Longer levels are steadier: on two H200 a c=64 level of 32 a user lasted 0.6 s, and two "
                        "sweeps of it differed by up to 35 %% (docs/performance-log.md)")
    p.add_argument("--output-spread", type=int, default=0, metavar="N",
                   help="each request's output length uniform in output-tokens +- N (default 0: all equal, so a "
                        "closed loop's requests end and return together, in waves)")
    p.add_argument("--client-processes", default="auto", metavar="N|auto",
                   help="processes the load generator spreads each level's users over (default auto: one per 16 "
                        "users, at most half the cores; one process parsing every streamed event saturates its "
                        "core at tens of thousands of tokens/s, and the level would measure the client)")
    p.add_argument("--rate", type=rate, help="open loop: requests/s (Poisson) instead of a closed loop")
    p.add_argument("--warmup", type=int, help="warm-up requests per level")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts of level i come from seed + i: no level repeats an earlier level's prompts, and "
                        "the same seed sends the same prompts again (default 0; a second sweep of the same run "
                        "with the same seed finds its prompts in the prefix cache)")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT/ITL)")
    p.add_argument("--ttft-target", type=float, metavar="MS",
                   help="send this TTFT target (extra_args.ttft_target): a global router picks pools by it")
    p.add_argument("--itl-target", type=float, metavar="MS", help="send this ITL target (extra_args.itl_target)")
    p.add_argument("--priority", type=int, help="send nvext.agent_hints.priority (the global router's overrides)")
    p.add_argument("--videos", type=int, help="video runs: videos per level (default: 2 per concurrent user)")
    p.add_argument("--size", help="video runs: WxH (default: the recipe's)")
    p.add_argument("--frames", type=int, help="video runs: frames per video (default: the recipe's)")
    p.add_argument("--steps", type=int, help="video runs: denoising steps (default: the recipe's)")
    p.add_argument("--out", type=Path, help="output directory (default: RUN/bench/<time> or ./bench/<time>)")
    p.add_argument("--in-job", action="store_true",
                   help="run the load generator as a one-node job on the run's cluster (submitit) and relay its "
                        "output: a busy login node skews latencies, and may not reach the compute nodes at all")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), type=Path,
                   help="plot two results.json (or their directories) against each other")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from hpc.bench.run import bench

    return bench(args)
