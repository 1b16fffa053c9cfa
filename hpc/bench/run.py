"""`hpc bench`: a sweep against a run's frontend (or any OpenAI endpoint), here or as a job on the run's cluster
(hpc.bench.in_job), and the comparison of two results. The command line is parsed in hpc.cli.bench_command."""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import sys
import time
from typing import cast
from pathlib import Path

from hpc.errors import UserError


def _load(path: Path) -> dict:
    path = path / "results.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read bench results: {exc}", file=str(path)) from None


def bench(args: argparse.Namespace) -> int:
    from hpc.bench import report
    from hpc.bench.clients import run_sweep

    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.compare:
        return _compare(args, stamp)
    url, model, run = _target(args)
    spec = run.manifest().recipe.benchmark if run is not None else None
    if args.in_job:
        if run is None:
            raise UserError("--in-job runs on a run's cluster; --url names no cluster", field="--in-job",
                            hint="bench a run (hpc bench RUN --in-job), or leave --in-job out")
        from hpc.bench.in_job import bench_in_job

        return bench_in_job(args, run, bench_on_node)
    if run is not None and run.manifest().recipe.modality == "video_diffusion":
        return _bench_videos(args, run, url, model, stamp)
    levels = _levels(args, spec)
    warmup = args.warmup if args.warmup is not None else (spec.warmup_requests if spec else 4)
    streaming = not args.no_stream and (spec.streaming if spec else True)
    engines = None
    if run is not None:  # the run's engines: how much of a request's time they held, level by level
        from hpc.bench.engines import EngineCounters, metrics_urls

        urls = metrics_urls(run.path)
        engines = EngineCounters(urls) if urls else None
    finished: list[dict] = []
    results = {"target": url, "model": model, "streaming": streaming, "started": stamp, "seed": args.seed,
               "client": {"host": socket.gethostname(), "pid": os.getpid()}, "levels": finished}
    out = args.out or ((run.path / "bench" / stamp) if run else Path("bench") / stamp)
    try:
        run_sweep(url, model, levels, streaming, warmup, seed=args.seed, processes=args.client_processes,
                  engines=engines, done=finished)
    except KeyboardInterrupt:
        # the levels that ended are measurements: keep them, marked as a sweep that did not finish
        if not finished:
            raise
        results["interrupted"] = f"after {len(finished)} of {len(levels)} levels"
    results["valid"] = "interrupted" not in results and all(lv["valid"] for lv in results["levels"])
    paths = report.write(results, out)
    print(report.table(results))
    print("wrote: " + ", ".join(str(p) for p in paths))
    if "interrupted" in results:
        print(f"interrupted {results['interrupted']}", file=sys.stderr)
        return 130
    if not results["valid"]:
        print("INVALID: this result must not be reported (see the 'valid' column)")
        return 1
    return 0


def _compare(args: argparse.Namespace, stamp: str) -> int:
    from hpc.bench import report

    a, b = (_load(p) for p in args.compare)
    out = args.out or Path("bench") / f"compare-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    paths = report.plot({str(args.compare[0]): a, str(args.compare[1]): b}, out)
    for label, res in ((args.compare[0], a), (args.compare[1], b)):
        print(f"{label}:\n{report.table(res)}")
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def _target(args: argparse.Namespace):
    """(url, model, the run or None): --url names a server, else the run's own frontend."""
    if args.url:
        if not args.model:
            raise UserError("--model is required with --url", field="--model")
        return args.url.rstrip("/").removesuffix("/v1"), args.model, None
    from hpc.rundir import find_run

    run = find_run(args.run)
    m = run.manifest()
    url = run.frontend_url()
    if url is None:
        raise UserError(f"run {run.path.name} has no frontend endpoint yet", hint=f"hpc status {run.path.name}")
    return url, args.model or m.recipe.model.served_name, run


def _levels(args: argparse.Namespace, spec) -> list:
    """The sweep's levels from the flags, else the recipe's benchmark block; a flag out of range is one line."""
    from hpc.bench.loadgen import REQUESTS_PER_USER, Level

    concurrency = args.concurrency or (spec.concurrency if spec else [1, 4, 16])
    ins = args.input_tokens or ([s.input_tokens for s in spec.shapes] if spec else [128])
    outs = args.output_tokens or ([s.output_tokens for s in spec.shapes] if spec else [64])
    if len(ins) != len(outs):
        raise UserError("--input-tokens and --output-tokens need the same number of values")
    base = spec.requests_per_level if spec else 64
    # Explicit --requests is taken as given (the validity gate still flags a level that never reached its
    # concurrency); the default is the recipe's number, but never fewer than --requests-per-user (4) per user.
    for flag, value in (("--ttft-target", args.ttft_target), ("--itl-target", args.itl_target)):
        if value is not None and not 0 <= value < 1e9:
            raise UserError(f"{flag} {value:g} is not a latency in ms", field=flag, hint="pass a value >= 0")
    if args.output_spread < 0:
        raise UserError(f"--output-spread {args.output_spread} is negative", field="--output-spread",
                        hint="pass 0 (equal lengths) or a number of tokens")
    if args.client_processes != "auto" and not (args.client_processes.isdigit() and int(args.client_processes) > 0):
        raise UserError(f"--client-processes {args.client_processes!r} is not a number of processes",
                        field="--client-processes", hint="pass a whole number >= 1, or auto")
    per_user = REQUESTS_PER_USER if args.requests_per_user is None else args.requests_per_user
    if per_user < 1:
        raise UserError(f"--requests-per-user {per_user} is not a count of requests", field="--requests-per-user",
                        hint="pass a whole number >= 1")
    if args.requests_per_user is not None and args.requests is not None:
        raise UserError("--requests and --requests-per-user both set a level's requests", field="--requests-per-user",
                        hint="pass one of them")
    return [Level(c, i, o, args.requests or max(base, per_user * c), args.rate, args.ttft_target,
                  args.itl_target, args.priority, output_spread=args.output_spread)
            for i, o in zip(ins, outs) for c in concurrency]


def _bench_videos(args: argparse.Namespace, run, url: str, model: str, stamp: str) -> int:
    """Seconds per video, steps/s and the TeaCache skip rate per concurrency level."""
    from hpc.bench.videos import run_sweep, table

    d = run.manifest().recipe.diffusion
    shape = {"size": args.size or f"{d.default_width}x{d.default_height}",
             "num_frames": args.frames or d.default_num_frames,
             "num_inference_steps": args.steps or d.default_num_inference_steps}
    levels = args.concurrency or [1, 2]
    results = {"target": url, "model": model, "started": stamp, "kind": "video",
               "levels": run_sweep(url, model, levels, args.videos or 2 * max(levels), shape)}
    results["valid"] = all(lv["valid"] for lv in results["levels"])
    out = args.out or run.path / "bench" / stamp
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(table(results["levels"]))
    print(f"wrote: {out / 'results.json'}")
    if not results["valid"]:
        print("INVALID: this result must not be reported (failed or missing videos)")
        return 1
    return 0


def bench_on_node(args: argparse.Namespace) -> int:
    """What a bench job runs: `hpc bench` itself, on the node, with the run named by its path."""
    cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True)  # the submitting side relays it as it comes
    try:
        return bench(args)
    except UserError as exc:
        print(f"error: {exc.render()}", flush=True)
        return 2
