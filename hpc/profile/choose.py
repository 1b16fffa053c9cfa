"""From measured points to a deployment, pure: the SLA choice (the highest per-GPU throughput among the TP sizes
that meet TTFT and ITL), the recipe that deploys it, and — when different sizes win different regions of
(input length, TTFT target) or ITL target — a global-router config over pools of the winners (seed 003)."""

from __future__ import annotations

from typing import Any

from hpc.bench.loadgen import REQUESTS_PER_USER
from hpc.profile.spec import ProfileRequest
from hpc.spec.modifiers import with_parallel
from hpc.spec.recipe import BenchShape, PoolSpec, Recipe

Measured = dict[str, Any]  # one point's figures: phase, tp, isl, concurrency, ttft_ms, itl_ms, tok_s, valid
# A router grid's target axis, as a multiple of the SLA: uniform cells (as Dynamo's grids are) from a quarter to
# 2.25 x, whose middles are 0.5, 1, 1.5 and 2 x.
GRID_LO, GRID_HI, GRID_CELLS = 0.25, 2.25, 4
GRID_MIDDLES = [GRID_LO + (i + 0.5) * (GRID_HI - GRID_LO) / GRID_CELLS for i in range(GRID_CELLS)]


def ttft_at(points: list[Measured], tp: int, isl: float) -> float | None:
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


def _decode_levels(points: list[Measured], tp: int) -> list[Measured]:
    return [p for p in points if p["phase"] == "decode" and p["tp"] == tp and p["valid"] and p["itl_ms"] is not None]


def decode_best(points: list[Measured], tp: int, itl_ms: float) -> Measured | None:
    """The decode level of TP `tp` with the most tokens/s whose ITL meets the target."""
    return max((p for p in _decode_levels(points, tp) if p["itl_ms"] <= itl_ms), key=lambda p: p["tok_s"],
               default=None)


def _winner(options: list[tuple[int, float]]) -> int:
    """(TP, tokens/s per GPU) options -> the TP with the most per GPU; the smaller TP on a tie."""
    return max(options, key=lambda o: (o[1], -o[0]))[0]


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
            lows = _decode_levels(points, tp)
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
            "requests_per_level": max(out.benchmark.requests_per_level, REQUESTS_PER_USER * dec["concurrency"])})
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
    prefill_map = []
    for r in range(rows):
        isl = (r + 0.5) * step
        figures = [(tp, t) for tp in tps if (t := ttft_at(points, tp, isl)) is not None]
        row = []
        for target in (m * req.ttft_ms for m in GRID_MIDDLES):
            meeting = [(tp, isl / max(t, 1e-9) / tp) for tp, t in figures if t <= target]  # prefill tok/s per GPU
            if meeting:
                row.append(_winner(meeting))
            else:
                row.append(min(figures, key=lambda f: f[1])[0])
        prefill_map.append(row)
    decode_row = []
    for target in (m * req.itl_ms for m in GRID_MIDDLES):
        meeting = [(tp, b["tok_s"] / tp) for tp in tps if (b := decode_best(points, tp, target)) is not None]
        decode_row.append(_winner(meeting) if meeting else max(tps))
    prefill_tps = sorted({tp for row in prefill_map for tp in row})
    decode_tps = sorted(set(decode_row))
    if len(prefill_tps) == 1 and len(decode_tps) == 1:
        return None
    return {
        "mode": "disagg", "enable_priority_retry": True,
        **_pools("prefill", prefill_tps), **_pools("decode", decode_tps),
        "prefill_pool_selection_strategy": {
            "isl_min": 0, "isl_max": isls[-1], "isl_resolution": rows, **_axis("ttft", req.ttft_ms),
            "prefill_pool_mapping": [[prefill_tps.index(tp) for tp in row] for row in prefill_map]},
        "decode_pool_selection_strategy": {
            "context_length_min": 0, "context_length_max": max(isls[-1], req.isl) + req.osl,
            "context_length_resolution": 1, **_axis("itl", req.itl_ms),
            "decode_pool_mapping": [[decode_tps.index(tp) for tp in decode_row]]},
    }


def _pools(kind: str, tps: list[int]) -> dict[str, Any]:
    """A grid's pools of one kind: one per TP size, named as the profile names its engines; a larger TP is
    faster (a lower priority number), so a failed smaller one retries on it."""
    return {f"num_{kind}_pools": len(tps), f"{kind}_pool_dynamo_namespaces": [f"{kind}-tp{t}" for t in tps],
            f"{kind}_pool_priorities": [len(tps) - i for i in range(len(tps))]}


def _axis(name: str, sla_ms: float) -> dict[str, Any]:
    return {f"{name}_min_ms": GRID_LO * sla_ms, f"{name}_max_ms": GRID_HI * sla_ms, f"{name}_resolution": GRID_CELLS}


def agg_router_grid(points: list[Measured], req: ProfileRequest) -> dict[str, Any] | None:
    """An aggregated recipe's grid over (TTFT target, ITL target), columns as router_grid's: in each cell the TP
    size with the most decode tokens/s per GPU among those that meet both (TTFT at the profiled input length),
    else the fastest. None when one size wins everywhere."""
    tps = sorted({p["tp"] for p in points})
    ttft = {tp: t for tp in tps if (t := ttft_at(points, tp, req.isl)) is not None}  # one figure per size
    mapping = []
    for ttft_target in (m * req.ttft_ms for m in GRID_MIDDLES):
        row = []
        for itl_target in (m * req.itl_ms for m in GRID_MIDDLES):
            meeting = [(tp, b["tok_s"] / tp) for tp, t in ttft.items() if t <= ttft_target
                       and (b := decode_best(points, tp, itl_target)) is not None]
            row.append(_winner(meeting) if meeting else max(tps))
        mapping.append(row)
    used = sorted({tp for row in mapping for tp in row})
    if len(used) == 1:
        return None
    return {"mode": "agg", "enable_priority_retry": True, **_pools("agg", used),
            "agg_pool_selection_strategy": {**_axis("ttft", req.ttft_ms), **_axis("itl", req.itl_ms),
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
