"""The profile's plan, pure: one recipe holding a warm engine per (phase, TP size) as pools of an aggregated role
(the config modifiers turn each disaggregated role into its aggregated profiling form), the global router's
priority rules that address each pool, and the points each engine is measured at."""

from __future__ import annotations

from typing import Any, NamedTuple

from hpc.profile.spec import ProfileRequest
from hpc.spec.modifiers import to_agg, with_parallel
from hpc.spec.recipe import PoolSpec, Recipe, Roles, RoleSpec, RouterPolicy


class Engine(NamedTuple):
    pool: str  # the pool's name in the profile recipe
    phase: str  # what its numbers stand for: prefill, decode, or agg (both)
    tp: int
    priority: int  # nvext.agent_hints.priority that the profile's global router sends to this pool


class Point(NamedTuple):
    phase: str  # prefill: TTFT at `isl`, one request at a time; decode: ITL at `concurrency`, context isl
    tp: int
    pool: str
    priority: int
    isl: int
    osl: int
    concurrency: int

    @property
    def key(self) -> str:
        x = f"isl{self.isl}" if self.phase == "prefill" else f"c{self.concurrency}"
        return f"{self.phase}/tp{self.tp}/{x}"


def engines(recipe: Recipe, tps: list[int]) -> list[Engine]:
    phases = ("prefill", "decode") if recipe.disaggregated else ("agg",)
    out = []
    for phase in phases:
        for tp in sorted(tps):
            out.append(Engine(f"{phase}-tp{tp}", phase, tp, len(out)))
    return out


def profile_recipe(recipe: Recipe, tps: list[int]) -> Recipe:
    """Every engine of the profile as a pool of one aggregated role; requests reach a pool by priority."""
    pools = []
    for engine in engines(recipe, tps):
        role = "agg" if engine.phase == "agg" else engine.phase
        single = recipe if role == "agg" else to_agg(recipe, role)  # the profiler's form of a prefill/decode role
        single = with_parallel(single, "agg", tp=engine.tp)
        spec = single.roles.agg.model_dump(exclude={"pools", "count", "failure"})
        pools.append(PoolSpec(name=engine.pool, count=1, **spec))
    names = [e.pool for e in engines(recipe, tps)]
    router: dict[str, Any] = {
        "mode": "agg", "num_agg_pools": len(names), "agg_pool_dynamo_namespaces": names,
        "agg_pool_selection_strategy": {
            "ttft_min_ms": 0, "ttft_max_ms": 1, "ttft_resolution": 1, "itl_min_ms": 0, "itl_max_ms": 1,
            "itl_resolution": 1, "agg_pool_mapping": [[0]],
            "priority_overrides": [{"min_priority": i, "max_priority": i, "target_pool": i}
                                   for i in range(len(names))]}}
    frontend = recipe.frontend.model_copy(update={"global_router": router, "router": RouterPolicy.ROUND_ROBIN})
    return recipe.model_copy(update={
        "name": f"{recipe.name}-profile"[:64], "roles": Roles(agg=RoleSpec(pools=pools), encode=recipe.roles.encode),
        "frontend": frontend, "smoke": recipe.smoke.model_copy(update={"enabled": False}),
        "description": f"hpc profile of {recipe.name}: one warm engine per phase and TP size"})


def isl_points(req: ProfileRequest, max_input: int) -> list[int]:
    """TTFT is measured around the target input length: a quarter, half, the target and twice it."""
    return sorted({max(1, min(max_input, x)) for x in (req.isl // 4, req.isl // 2, req.isl, req.isl * 2)})


def concurrency_levels(req: ProfileRequest, max_batch: int | None) -> list[int]:
    top = min(req.max_concurrency, max_batch or req.max_concurrency)
    levels, c = [], 1
    while c <= top:
        levels.append(c)
        c *= 2
    return levels


def points(recipe: Recipe, req: ProfileRequest, engine_args: dict[str, dict[str, Any]]) -> list[Point]:
    out = []
    for e in engines(recipe, req.tps):
        if e.phase in ("prefill", "agg"):
            for isl in isl_points(req, recipe.limits.max_input_tokens):
                out.append(Point("prefill", e.tp, e.pool, e.priority, isl, 1, 1))
        if e.phase in ("decode", "agg"):
            batch = (engine_args.get(e.pool) or {}).get("max_batch_size")
            for c in concurrency_levels(req, batch if isinstance(batch, int) else None):
                out.append(Point("decode", e.tp, e.pool, e.priority, req.isl, req.osl, c))
    return out


def requests_at(point: Point, req: ProfileRequest) -> int:
    """Enough that every decode level really has `concurrency` requests in flight (the bench validity gate)."""
    return req.requests if point.phase == "prefill" else max(req.requests, 2 * point.concurrency)
