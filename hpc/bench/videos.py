"""`hpc bench` of a video-diffusion run (seed 004): videos per concurrency level, seconds per video, denoising
steps per second and the TeaCache skip rate, from each response's own figures."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from hpc.net.httpclient import Pool
from hpc.bench.loadgen import MAX_FAILURE_RATE, percentiles


async def _one(pool: Pool, body: dict[str, Any]) -> dict[str, Any]:
    conn = pool.take()
    t0 = time.perf_counter()
    try:
        status, raw = await conn.request("POST", "/v1/videos", json.dumps(body).encode())
        pool.give(conn, True)
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        pool.give(conn, False)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "e2e": time.perf_counter() - t0}
    ok = status == 200 and data.get("status") == "completed"
    return {"ok": ok, "e2e": time.perf_counter() - t0, "error": "" if ok else str(data.get("error"))[:200],
            "inference_s": data.get("inference_time_s") or 0.0, "calls": data.get("transformer_calls") or 0,
            "skipped": data.get("teacache_skipped_calls") or 0}


async def run_level(url: str, model: str, concurrency: int, videos: int, shape: dict[str, Any]) -> dict[str, Any]:
    pool = Pool(url)
    queue = list(range(videos))
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def user(n: int) -> None:
        while queue:
            i = queue.pop()
            results.append(await _one(pool, {"model": model, "prompt": f"bench video {i}", "seed": i, **shape}))

    await asyncio.gather(*[user(n) for n in range(concurrency)])
    wall = time.perf_counter() - t0
    pool.close()
    ok = [r for r in results if r["ok"]]
    steps = sum(r["calls"] + r["skipped"] for r in ok)  # transformer steps, both CFG branches
    failure_rate = 1 - len(ok) / len(results) if results else 1.0
    return {"concurrency": concurrency, "videos": videos, "completed": len(ok), "failure_rate": failure_rate,
            "wall_s": wall, "videos_per_s": len(ok) / wall if wall else 0.0,
            "seconds_per_video": percentiles([r["e2e"] for r in ok]),
            "inference_s": percentiles([r["inference_s"] for r in ok]),
            "steps_per_s": steps / wall if wall else 0.0,
            "teacache_skip_rate": sum(r["skipped"] for r in ok) / steps if steps else 0.0,
            "errors": sorted({r["error"] for r in results if r["error"]})[:5],
            "valid": bool(ok) and failure_rate <= MAX_FAILURE_RATE and len(ok) == videos, **shape}


def run_sweep(url: str, model: str, levels: list[int], videos: int, shape: dict[str, Any]) -> list[dict[str, Any]]:
    async def sweep() -> list[dict[str, Any]]:
        return [await run_level(url, model, c, max(videos, c), shape) for c in levels]
    return asyncio.run(sweep())


def table(levels: list[dict[str, Any]]) -> str:
    lines = [f"{'conc':>5} {'videos':>6} {'ok':>4} {'s/video p50':>11} {'p90':>7} {'videos/s':>9} {'steps/s':>8} "
             f"{'TeaCache skip':>13}  valid"]
    for lv in levels:
        s = lv["seconds_per_video"]
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"{lv['concurrency']:>5} {lv['videos']:>6} {lv['completed']:>4} {fmt(s['p50']):>11} "
                     f"{fmt(s['p90']):>7} {lv['videos_per_s']:>9.3f} {lv['steps_per_s']:>8.1f} "
                     f"{100 * lv['teacache_skip_rate']:>12.0f}%  {'yes' if lv['valid'] else 'NO'}")
    return "\n".join(lines)
