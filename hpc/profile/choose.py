"""From measured points to a deployment, pure: the SLA choice (the highest per-GPU throughput among the TP sizes
that meet TTFT and ITL), the recipe that deploys it, and — when different sizes win different regions of
(input length, TTFT target) or ITL target — a global-router config over pools of the winners (seed 003)."""

from __future__ import annotations

from typing import Any

from hpc.profile.spec import ProfileRequest
from hpc.spec.modifiers import with_parallel
from hpc.spec.recipe import BenchShape, PoolSpec, Recipe

Measured = dict[str, Any]  # one point's figures: phase, tp, isl, concurrency, ttft_ms, itl_ms, tok_s, valid


def ttft_at(points: list[Measured], tp: int, isl: int) -> float | None:
    """TTFT (ms) of TP `tp` at input length `isl`, interpolated linearly between measured lengths (held flat
    beyond them)."""
    curve = sorted((p["isl"], p["ttft_ms"]) for p in points
                   if p["phase"] == "prefill" and p["tp"] == tp and p["valid"] and p["ttft_ms"] is not None)
    if not curve:
        return None
    if isl <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= isl <= x1:
            return y0 + (y1 - y0) * (isl - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1]


def decode_best(points: list[Measured], tp: int, itl_ms: float) -> Measured | None:
    """The decode level of TP `tp` with the most tokens/s whose ITL meets the target."""
    ok = [p for p in points if p["phase"] == "decode" and p["tp"] == tp and p["valid"] and p["itl_ms"] is not None
          and p["itl_ms"] <= itl_ms]
    return max(ok, key=lambda p: p["tok_s"], default=None)


def choose(points: list[Measured], req: ProfileRequest) -> dict[str, Any]:
    """Per phase: every TP size's figures at the target, and the one chosen (met: whether it meets the SLA; when
    none does, the closest is chosen and met is false)."""
    tps = sorted({p["tp"] for p in points})
    prefill = []
    for tp in tps:
        ttft = ttft_at(points, tp, req.isl)
        if ttft is not None:
            prefill.append({"tp": tp, "ttft_ms": ttft, "meets": ttft <= req.ttft_ms,
                            "tok_s_per_gpu": req.isl / (ttft / 1000) / tp if ttft > 0 else 0.0})
    decode = []
    for tp in tps:
        best = decode_best(points, tp, req.itl_ms)
        if best is not None:
            decode.append({"tp": tp, "concurrency": best["concurrency"], "itl_ms": best["itl_ms"], "meets": True,
                           "tok_s": best["tok_s"], "tok_s_per_gpu": best["tok_s"] / tp})
        else:
            lows = [p for p in points if p["phase"] == "decode" and p["tp"] == tp and p["valid"]
                    and p["itl_ms"] is not None]
            if lows:
                low = min(lows, key=lambda p: p["itl_ms"])
                decode.append({"tp": tp, "concurrency": low["concurrency"], "itl_ms": low["itl_ms"], "meets": False,
                               "tok_s": low["tok_s"], "tok_s_per_gpu": low["tok_s"] / tp})
    return {"prefill": {"candidates": prefill, "chosen": _pick(prefill, "ttft_ms")},
            "decode": {"candidates": decode, "chosen": _pick(decode, "itl_ms")}}


def _pick(candidates: list[dict[str, Any]], latency: str) -> dict[str, Any] | None:
    meeting = [c for c in candidates if c["meets"]]
    if meeting:  # the most throughput per GPU; the smaller TP on a tie
        return max(meeting, key=lambda c: (c["tok_s_per_gpu"], -c["tp"]))
    return min(candidates, key=lambda c: c[latency], default=None)


def emitted_recipe(recipe: Recipe, choice: dict[str, Any], req: ProfileRequest) -> Recipe:
    """The original recipe at the chosen sizes, set through the override layer, its benchmark at the profiled
    shape and the chosen decode concurrency (so that a plain `hpc bench` of it measures the profiled point)."""
    pre, dec = choice["prefill"]["chosen"], choice["decode"]["chosen"]
    out = recipe
    if recipe.disaggregated:
        if pre is not None:
            out = with_parallel(out, "prefill", tp=pre["tp"])
        if dec is not None:
            out = with_parallel(out, "decode", tp=dec["tp"])
    elif dec is not None or pre is not None:
        out = with_parallel(out, "agg", tp=(dec or pre)["tp"])
    if dec is not None:
        bench = out.benchmark.model_copy(update={
            "concurrency": sorted({1, dec["concurrency"]}), "shapes": [BenchShape(input_tokens=req.isl,
                                                                                output_tokens=req.osl)],
            "requests_per_level": max(out.benchmark.requests_per_level, 4 * dec["concurrency"])})
        out = out.model_copy(update={"benchmark": bench})
    return out.model_copy(update={"name": f"{recipe.name}-sla"[:64]})


def router_grid(points: list[Measured], req: ProfileRequest, isls: list[int]) -> dict[str, Any] | None:
    """Dynamo's global_router JSON over pools of every TP size that wins some cell, None when one size wins
    everywhere. Cells are uniform, as Dynamo's grids are: input lengths from 0 to the longest measured (TTFT
    interpolated at each row's middle), TTFT and ITL targets from a quarter to 2.25 x the SLA (columns in the
    middle at 0.5, 1, 1.5 and 2 x); decode has one context row, the profiled one."""
    tps = sorted({p["tp"] for p in points})
    rows = len(isls)
    step = isls[-1] / rows
    lo, hi, cols = 0.25, 2.25, 4
    middles = [lo + (i + 0.5) * (hi - lo) / cols for i in range(cols)]  # 0.5, 1.0, 1.5, 2.0 x the SLA
    prefill_map = []
    for r in range(rows):
        isl = (r + 0.5) * step
        figures = [(tp, t) for tp in tps if (t := ttft_at(points, tp, isl)) is not None]
        row = []
        for target in (m * req.ttft_ms for m in middles):
            meeting = [(tp, t) for tp, t in figures if t <= target]
            if meeting:  # per-GPU prefill throughput: isl / ttft / tp
                row.append(max(meeting, key=lambda f: (isl / max(f[1], 1e-9) / f[0], -f[0]))[0])
            else:
                row.append(min(figures, key=lambda f: f[1])[0])
        prefill_map.append(row)
    decode_row = []
    for target in (m * req.itl_ms for m in middles):
        meeting = [(tp, b) for tp in tps if (b := decode_best(points, tp, target)) is not None]
        decode_row.append(max(meeting, key=lambda f: (f[1]["tok_s"] / f[0], -f[0]))[0] if meeting else max(tps))
    prefill_tps = sorted({tp for row in prefill_map for tp in row})
    decode_tps = sorted(set(decode_row))
    if len(prefill_tps) == 1 and len(decode_tps) == 1:
        return None
    return {
        "mode": "disagg", "enable_priority_retry": True,
        "num_prefill_pools": len(prefill_tps), "num_decode_pools": len(decode_tps),
        "prefill_pool_dynamo_namespaces": [f"prefill-tp{t}" for t in prefill_tps],
        "decode_pool_dynamo_namespaces": [f"decode-tp{t}" for t in decode_tps],
        # a larger TP is faster: a failed smaller one retries on it
        "prefill_pool_priorities": [len(prefill_tps) - i for i in range(len(prefill_tps))],
        "decode_pool_priorities": [len(decode_tps) - i for i in range(len(decode_tps))],
        "prefill_pool_selection_strategy": {
            "isl_min": 0, "isl_max": isls[-1], "isl_resolution": rows,
            "ttft_min_ms": lo * req.ttft_ms, "ttft_max_ms": hi * req.ttft_ms, "ttft_resolution": cols,
            "prefill_pool_mapping": [[prefill_tps.index(tp) for tp in row] for row in prefill_map]},
        "decode_pool_selection_strategy": {
            "context_length_min": 0, "context_length_max": max(isls[-1], req.isl) + req.osl,
            "context_length_resolution": 1, "itl_min_ms": lo * req.itl_ms, "itl_max_ms": hi * req.itl_ms,
            "itl_resolution": cols, "decode_pool_mapping": [[decode_tps.index(tp) for tp in decode_row]]},
    }


def agg_router_grid(points: list[Measured], req: ProfileRequest) -> dict[str, Any] | None:
    """An aggregated recipe's grid over (TTFT target, ITL target), columns as router_grid's: in each cell the TP
    size with the most decode tokens/s per GPU among those that meet both (TTFT at the profiled input length),
    else the fastest. None when one size wins everywhere."""
    tps = sorted({p["tp"] for p in points})
    lo, hi, cols = 0.25, 2.25, 4
    middles = [lo + (i + 0.5) * (hi - lo) / cols for i in range(cols)]
    mapping = []
    for ttft_target in (m * req.ttft_ms for m in middles):
        row = []
        for itl_target in (m * req.itl_ms for m in middles):
            meeting = [(tp, b) for tp in tps if (t := ttft_at(points, tp, req.isl)) is not None and t <= ttft_target
                       and (b := decode_best(points, tp, itl_target)) is not None]
            row.append(max(meeting, key=lambda f: (f[1]["tok_s"] / f[0], -f[0]))[0] if meeting else max(tps))
        mapping.append(row)
    used = sorted({tp for row in mapping for tp in row})
    if len(used) == 1:
        return None
    return {"mode": "agg", "enable_priority_retry": True, "num_agg_pools": len(used),
            "agg_pool_dynamo_namespaces": [f"agg-tp{t}" for t in used],
            "agg_pool_priorities": [len(used) - i for i in range(len(used))],
            "agg_pool_selection_strategy": {
                "ttft_min_ms": lo * req.ttft_ms, "ttft_max_ms": hi * req.ttft_ms, "ttft_resolution": cols,
                "itl_min_ms": lo * req.itl_ms, "itl_max_ms": hi * req.itl_ms, "itl_resolution": cols,
                "agg_pool_mapping": [[used.index(tp) for tp in row] for row in mapping]}}


def pooled_recipe(recipe: Recipe, grid: dict[str, Any], router_file: str) -> Recipe:
    """The recipe with one pool per TP size the grid uses (each one worker), behind that grid."""
    roles = {}
    for role in ("agg",) if grid["mode"] == "agg" else ("prefill", "decode"):
        spec = getattr(recipe.roles, role)
        pools = []
        for name in grid[f"{role}_pool_dynamo_namespaces"]:
            tp = int(name.rsplit("tp", 1)[1])
            sized = with_parallel(recipe, role, tp=tp)
            fields = getattr(sized.roles, role).model_dump(exclude={"pools", "count"})
            pools.append(PoolSpec(name=name, count=1, **fields))
        roles[role] = spec.model_copy(update={"pools": pools, "count": 1})
    frontend = recipe.frontend.model_copy(update={"global_router": router_file})
    return recipe.model_copy(update={"name": f"{recipe.name}-pools"[:64], "frontend": frontend,
                                     "roles": recipe.roles.model_copy(update=roles)})
