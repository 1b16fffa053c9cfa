"""The profile's plan, pure: one recipe holding a warm engine per (phase, TP size) as pools, the global router's
priority rules that address each pool, and the points each engine is measured at.

Two forms. `disagg` (the default for a disaggregated recipe): prefill and decode pools in the roles they serve in,
so a decode level measures a decode worker fed by prefill workers, as the deployment runs it. `agg` (Dynamo's
profiler, and every aggregated recipe): each role converted to its aggregated profiling form by the config
modifiers, every engine a pool of one aggregated role.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from hpc.bench.loadgen import REQUESTS_PER_USER
from hpc.profile.spec import ProfileRequest
from hpc.spec.modifiers import to_agg, with_parallel
from hpc.spec.recipe import PoolSpec, Recipe, Roles, RoleSpec, RouterPolicy

Form = Literal["disagg", "agg"]


Phase = Literal["prefill", "decode", "agg"]


class Engine(NamedTuple):
    pool: str  # the pool's name in the profile recipe
    phase: Phase  # what its numbers stand for: prefill, decode, or agg (both)
    tp: int
    index: int  # among the pools of its role in the profile recipe


class Point(NamedTuple):
    phase: str  # prefill: TTFT at `isl`, one request at a time; decode: ITL at `concurrency`, context isl
    tp: int
    pool: str
    priority: int  # nvext.agent_hints.priority: the profile's global router sends it to `pool`
    isl: int
    osl: int
    concurrency: int

    @property
    def key(self) -> str:
        x = f"isl{self.isl}" if self.phase == "prefill" else f"c{self.concurrency}"
        return f"{self.phase}/tp{self.tp}/{x}"


def default_form(recipe: Recipe) -> Form:
    return "disagg" if recipe.disaggregated else "agg"


def engines(recipe: Recipe, tps: list[int], form: Form | None = None) -> list[Engine]:
    """Largest TP first: the planner fills nodes in order, so whole-node engines come before those that share."""
    form = form or default_form(recipe)
    phases: tuple[Phase, ...] = ("prefill", "decode") if recipe.disaggregated else ("agg",)
    out: list[Engine] = []
    for tp in sorted(tps, reverse=True):
        for phase in phases:
            index = len(out) if form == "agg" else sum(e.phase == phase for e in out)
            out.append(Engine(f"{phase}-tp{tp}", phase, tp, index))
    return out


def pair_priority(prefill_pool: int, decode_pool: int, n_decode: int) -> int:
    """The disaggregated form's priority for one (prefill pool, decode pool) pair; profile_recipe's router rules
    read it back."""
    return prefill_pool * n_decode + decode_pool


def _priority(engine: Engine, form: Form, n_decode: int) -> int:
    """A prefill point pairs its engine with decode pool 0, a decode point its engine with prefill pool 0 until
    fed_by() names the prefill it runs with; the aggregated form numbers its engines."""
    if form == "agg":
        return engine.index
    if engine.phase == "prefill":
        return pair_priority(engine.index, 0, n_decode)
    return pair_priority(0, engine.index, n_decode)


def fed_by(point: Point, recipe: Recipe, req: ProfileRequest, prefill_tp: int) -> Point:
    """A decode point of the disaggregated form fed by the prefill engine of `prefill_tp` (the one the SLA choice
    picked: the decode figures are then those of the deployment the profile writes)."""
    all_engines = engines(recipe, req.tps, "disagg")
    n_decode = sum(e.phase == "decode" for e in all_engines)
    prefill = next(e for e in all_engines if e.phase == "prefill" and e.tp == prefill_tp)
    return point._replace(priority=pair_priority(prefill.index, point.priority % n_decode, n_decode))


def profile_recipe(recipe: Recipe, tps: list[int], form: Form | None = None) -> Recipe:
    """Every engine of the profile as a pool; requests reach their pool by priority."""
    form = form or default_form(recipe)
    all_engines = engines(recipe, tps, form)
    pools: dict[str, list[PoolSpec]] = {}
    for engine in all_engines:
        if form == "agg":
            single = recipe if engine.phase == "agg" else to_agg(recipe, engine.phase)  # the profiler's form
            role, single = "agg", with_parallel(single, "agg", tp=engine.tp)
        else:
            role, single = engine.phase, with_parallel(recipe, engine.phase, tp=engine.tp)
        spec = getattr(single.roles, role).model_dump(exclude={"pools", "count", "failure"})
        pools.setdefault(role, []).append(PoolSpec(name=engine.pool, count=1, **spec))
    names = {role: [p.name for p in specs] for role, specs in pools.items()}
    any_cell = {"ttft_min_ms": 0, "ttft_max_ms": 1, "ttft_resolution": 1, "itl_min_ms": 0, "itl_max_ms": 1,
                "itl_resolution": 1}
    if form == "agg":
        router: dict[str, Any] = {
            "mode": "agg", "num_agg_pools": len(names["agg"]), "agg_pool_dynamo_namespaces": names["agg"],
            "agg_pool_selection_strategy": {**any_cell, "agg_pool_mapping": [[0]], "priority_overrides": [
                {"min_priority": i, "max_priority": i, "target_pool": i} for i in range(len(names["agg"]))]}}
        roles = Roles(agg=RoleSpec(pools=pools["agg"]), encode=recipe.roles.encode)
    else:
        n_pre, n_dec = len(names["prefill"]), len(names["decode"])
        router = {
            "mode": "disagg", "num_prefill_pools": n_pre, "num_decode_pools": n_dec,
            "prefill_pool_dynamo_namespaces": names["prefill"], "decode_pool_dynamo_namespaces": names["decode"],
            "prefill_pool_selection_strategy": {
                "isl_min": 0, "isl_max": 1, "isl_resolution": 1, **{k: v for k, v in any_cell.items()
                                                                   if k.startswith("ttft")},
                "prefill_pool_mapping": [[0]], "priority_overrides": [
                    {"min_priority": pair_priority(i, 0, n_dec), "max_priority": pair_priority(i, n_dec - 1, n_dec),
                     "target_pool": i} for i in range(n_pre)]},
            "decode_pool_selection_strategy": {
                "context_length_min": 0, "context_length_max": 1, "context_length_resolution": 1,
                **{k: v for k, v in any_cell.items() if k.startswith("itl")}, "decode_pool_mapping": [[0]],
                "priority_overrides": [{"min_priority": pair_priority(i, j, n_dec),
                                        "max_priority": pair_priority(i, j, n_dec), "target_pool": j}
                                       for i in range(n_pre) for j in range(n_dec)]}}
        roles = Roles(prefill=RoleSpec(pools=pools["prefill"]), decode=RoleSpec(pools=pools["decode"]),
                      encode=recipe.roles.encode)
    frontend = recipe.frontend.model_copy(update={"global_router": router, "router": RouterPolicy.ROUND_ROBIN})
    return recipe.model_copy(update={
        "name": f"{recipe.name}-profile"[:64], "roles": roles,
        "frontend": frontend, "smoke": recipe.smoke.model_copy(update={"enabled": False}),
        # as few nodes as the engines fit on: the profile measures engines, not the serving layout
        "placement": "pack", "infra": recipe.infra.model_copy(update={"placement": "shared"}),
        "description": f"hpc profile of {recipe.name} ({form} form): one warm engine per phase and TP size"})


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


def points(recipe: Recipe, req: ProfileRequest, engine_args: dict[str, dict[str, Any]],
           form: Form | None = None) -> list[Point]:
    form = form or default_form(recipe)
    all_engines = engines(recipe, req.tps, form)
    n_decode = sum(e.phase == "decode" for e in all_engines)
    out = []
    for e in all_engines:
        priority = _priority(e, form, n_decode)
        if e.phase in ("prefill", "agg"):
            for isl in isl_points(req, recipe.limits.max_input_tokens):
                out.append(Point("prefill", e.tp, e.pool, priority, isl, 1, 1))
        if e.phase in ("decode", "agg"):
            batch = (engine_args.get(e.pool) or {}).get("max_batch_size")
            for c in concurrency_levels(req, batch if isinstance(batch, int) else None):
                out.append(Point("decode", e.tp, e.pool, priority, req.isl, req.osl, c))
    return sorted(out, key=lambda p: p.phase != "prefill")  # prefill first: its choice feeds the decode levels


def requests_at(point: Point, req: ProfileRequest) -> int:
    """Enough that every decode level really has `concurrency` requests in flight for a while: 4 per user, as
    `hpc bench` sends by default (its validity gate)."""
    return req.requests if point.phase == "prefill" else max(req.requests, REQUESTS_PER_USER * point.concurrency)
