"""Measuring the points against the warm engines, each point saved as it finishes (an interrupted profile resumes
from its JSON)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import zlib
from pathlib import Path
from typing import Any, Callable

from hpc.errors import UserError
from hpc.profile.plan import Point, requests_at
from hpc.profile.spec import ProfileRequest
from hpc.rundir import write_atomic

RESULTS = "profile.json"


def load_results(out: Path, req: ProfileRequest, recipe: str, cluster: str) -> dict[str, Any]:
    """The JSON of an earlier run in `out` when it profiled the same thing (resume), else a fresh record."""
    path = out / RESULTS
    fresh = {"version": 1, "recipe": recipe, "cluster": cluster, "request": req.model_dump(), "points": {}}
    if not path.is_file():
        return fresh
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the profile to resume: {exc}", file=str(path)) from None
    if (data.get("recipe"), data.get("cluster"), data.get("request")) != (recipe, cluster, req.model_dump()):
        raise UserError("this directory holds a profile of something else (recipe, cluster or SLA inputs differ)",
                        file=str(path), hint="resume with the same inputs, or pass another --out")
    return data


def save(out: Path, results: dict[str, Any]) -> None:
    write_atomic(out / RESULTS, json.dumps(results, indent=2, sort_keys=True) + "\n")


def measure(point: Point, req: ProfileRequest, url: str, model: str) -> dict[str, Any]:
    """One point through the frontend (the pool picked by priority): its TTFT or ITL and throughput."""
    from hpc.bench.clients import processes_for
    from hpc.bench.clients import run_level
    from hpc.bench.loadgen import Level

    level = Level(point.concurrency, point.isl, point.osl, requests_at(point, req), priority=point.priority,
                  same_prompt=point.phase == "decode")
    warmup = 1 if point.phase == "prefill" else min(point.concurrency, 4)
    # prompts of this point's own: with one seed for all, a prefill point's prompts began with the tokens of the
    # shorter points' before it, which the worker's prefix cache held, and its TTFT came out too low
    # the users over client processes as hpc bench spreads them (one per 16): one process parsing every event
    # would cap the throughput a point measures
    res = asyncio.run(run_level(url, model, level, streaming=True, warmup=warmup,
                                seed=zlib.crc32(repr(tuple(point)).encode()),
                                processes=processes_for("auto", point.concurrency, os.cpu_count() or 1)))
    ms = lambda s: None if s is None else s * 1000  # noqa: E731
    return {"phase": point.phase, "tp": point.tp, "pool": point.pool, "isl": point.isl, "osl": point.osl,
            "concurrency": point.concurrency, "requests": level.requests, "ttft_ms": ms(res["ttft_s"]["p50"]),
            # per output token, per request: an engine that streams several tokens an event (TensorRT-LLM under
            # load, stream_interval) would otherwise look that many times slower between tokens
            "itl_ms": ms(res["tpot_s"]["p50"]), "tok_s": res["output_tokens_per_s"], "valid": res["valid"],
            "invalid_reasons": res["invalid_reasons"]}


def run_points(points: list[Point], req: ProfileRequest, url: str, model: str, out: Path, results: dict[str, Any],
               say: Callable[[str], None] = print, total: int | None = None,
               done_before: int = 0) -> dict[str, Any]:
    """Measure `points` (those not in `results` yet), saving after each; numbered n of `total` for progress."""
    todo = [p for p in points if p.key not in results["points"]]
    total = total or len(points)
    for n, point in enumerate(todo, 1):
        t0 = time.monotonic()
        got = measure(point, req, url, model)
        results["points"][point.key] = got
        save(out, results)
        figure = (f"TTFT p50 {got['ttft_ms']:.1f} ms" if point.phase == "prefill" and got["ttft_ms"] is not None
                  else f"ITL p50 {got['itl_ms']:.2f} ms, {got['tok_s']:.0f} tok/s" if got["itl_ms"] is not None
                  else "no figures")
        say(f"[{done_before + len(points) - len(todo) + n}/{total}] {point.pool} "
            f"{'isl ' + str(point.isl) if point.phase == 'prefill' else 'c=' + str(point.concurrency)}: {figure}"
            f"{'' if got['valid'] else ' (INVALID: ' + '; '.join(got['invalid_reasons']) + ')'}"
            f" [{time.monotonic() - t0:.1f} s]")
    return results
