"""The global router's configuration (seed 003): Dynamo's `global_router` JSON, accepted unchanged, and the pool
choice it describes.

Disaggregated mode picks a prefill pool from a grid over (input length, TTFT target) and a decode pool from a
grid over (context length, ITL target); aggregated mode picks one pool from (TTFT, ITL), or (ISL, TTFT, ITL) when
the `isl_*` fields are set. A value outside a grid's range takes the nearest cell; an absent target takes the
middle of its range. `priority_overrides` (first match wins, inclusive bounds) send a request with
`nvext.agent_hints.priority` in range to a fixed pool; `enable_priority_retry` retries a request that failed
before its first byte on faster pools (a lower `*_pool_priorities` number is faster; pool order by default).
Dynamo's older unit-less names (`ttft_min`, `itl_max`, ...) are read as the `_ms` ones. Every inconsistency is
one line naming the field (UserError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from hpc.errors import UserError
from hpc.spec.base import parse_model


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PriorityOverride(_Strict):
    min_priority: int
    max_priority: int
    target_pool: int


def _ms(name: str) -> Any:
    return Field(validation_alias=AliasChoices(f"{name}_ms", name))


class _TtftAxis(_Strict):
    ttft_min_ms: float = _ms("ttft_min")
    ttft_max_ms: float = _ms("ttft_max")
    ttft_resolution: int


class _ItlAxis(_Strict):
    itl_min_ms: float = _ms("itl_min")
    itl_max_ms: float = _ms("itl_max")
    itl_resolution: int


class PrefillGrid(_TtftAxis):
    isl_min: int
    isl_max: int
    isl_resolution: int
    prefill_pool_mapping: list[list[int]]
    priority_overrides: list[PriorityOverride] = []


class DecodeGrid(_ItlAxis):
    context_length_min: int
    context_length_max: int
    context_length_resolution: int
    decode_pool_mapping: list[list[int]]
    priority_overrides: list[PriorityOverride] = []


class AggGrid(_TtftAxis, _ItlAxis):
    agg_pool_mapping: list[list[int]] | list[list[list[int]]]
    priority_overrides: list[PriorityOverride] = []
    isl_min: int | None = None
    isl_max: int | None = None
    isl_resolution: int | None = None


class GlobalRouterConfig(_Strict):
    mode: Literal["disagg", "agg"] = "disagg"
    enable_priority_retry: bool = False
    num_prefill_pools: int | None = None
    num_decode_pools: int | None = None
    prefill_pool_dynamo_namespaces: list[str] | None = None
    decode_pool_dynamo_namespaces: list[str] | None = None
    prefill_pool_priorities: list[int] | None = None
    decode_pool_priorities: list[int] | None = None
    prefill_pool_selection_strategy: PrefillGrid | None = None
    decode_pool_selection_strategy: DecodeGrid | None = None
    num_agg_pools: int | None = None
    agg_pool_dynamo_namespaces: list[str] | None = None
    agg_pool_priorities: list[int] | None = None
    agg_pool_selection_strategy: AggGrid | None = None

    def kinds(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.mode == "disagg" else ("agg",)

    def pools(self, kind: str) -> list[str]:
        """The pool names of one kind (Dynamo's namespaces; hpc's pool names)."""
        return list(getattr(self, f"{kind}_pool_dynamo_namespaces") or [])

    def priorities(self, kind: str) -> list[int]:
        return list(getattr(self, f"{kind}_pool_priorities") or range(len(self.pools(kind))))

    # ---- the choice -----------------------------------------------------------------------------------------
    def prefill_pool(self, isl: int, ttft_ms: float | None = None, priority: int | None = None) -> int:
        g = _grid(self.prefill_pool_selection_strategy, "prefill")
        row = _cell(isl, g.isl_min, g.isl_max, g.isl_resolution)
        col = _cell(_mid(ttft_ms, g.ttft_min_ms, g.ttft_max_ms), g.ttft_min_ms, g.ttft_max_ms, g.ttft_resolution)
        return _override(g.prefill_pool_mapping[row][col], priority, g.priority_overrides)

    def decode_pool(self, context_length: int, itl_ms: float | None = None, priority: int | None = None) -> int:
        g = _grid(self.decode_pool_selection_strategy, "decode")
        row = _cell(context_length, g.context_length_min, g.context_length_max, g.context_length_resolution)
        col = _cell(_mid(itl_ms, g.itl_min_ms, g.itl_max_ms), g.itl_min_ms, g.itl_max_ms, g.itl_resolution)
        return _override(g.decode_pool_mapping[row][col], priority, g.priority_overrides)

    def agg_pool(self, ttft_ms: float | None = None, itl_ms: float | None = None, priority: int | None = None,
                 isl: int | None = None) -> int:
        g = _grid(self.agg_pool_selection_strategy, "agg")
        t = _cell(_mid(ttft_ms, g.ttft_min_ms, g.ttft_max_ms), g.ttft_min_ms, g.ttft_max_ms, g.ttft_resolution)
        i = _cell(_mid(itl_ms, g.itl_min_ms, g.itl_max_ms), g.itl_min_ms, g.itl_max_ms, g.itl_resolution)
        if g.isl_min is None or g.isl_max is None or g.isl_resolution is None:
            pool = cast("list[list[int]]", g.agg_pool_mapping)[t][i]
        else:
            s = _cell(isl if isl is not None else (g.isl_min + g.isl_max) // 2, g.isl_min, g.isl_max,
                      g.isl_resolution)
            pool = cast("list[list[list[int]]]", g.agg_pool_mapping)[s][t][i]
        return _override(pool, priority, g.priority_overrides)

    def overridden(self, kind: str, priority: int) -> bool:
        """Whether a priority rule, not the grid, picks the pool of a `kind` request with this priority."""
        grid = getattr(self, f"{kind}_pool_selection_strategy")
        return any(r.min_priority <= priority <= r.max_priority for r in grid.priority_overrides)

    def retry_order(self, kind: str, chosen: int) -> list[int]:
        """The chosen pool, then (with enable_priority_retry) the faster ones, slowest of them first."""
        if not self.enable_priority_retry:
            return [chosen]
        prio = self.priorities(kind)
        faster = sorted({p for p in prio if p < prio[chosen]}, reverse=True)
        return [chosen] + [pool for level in faster for pool, p in enumerate(prio) if p == level]


_G = TypeVar("_G", PrefillGrid, DecodeGrid, AggGrid)


def _grid(grid: _G | None, kind: str) -> _G:
    if grid is None:  # check() refuses such a config as it loads
        raise ValueError(f"{kind}_pool_selection_strategy is not set")
    return grid


def _mid(value: float | None, low: float, high: float) -> float:
    return (low + high) / 2 if value is None else value


def _cell(value: float, low: float, high: float, resolution: int) -> int:
    return max(0, min(int((value - low) / ((high - low) / resolution)), resolution - 1))


def _override(pool: int, priority: int | None, rules: list[PriorityOverride]) -> int:
    if priority is not None:
        for rule in rules:
            if rule.min_priority <= priority <= rule.max_priority:
                return rule.target_pool
    return pool


# ---- loading and checking ------------------------------------------------------------------------------------
def load_global_router(path: str | Path) -> GlobalRouterConfig:
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read the global-router config: {exc.strerror}", file=str(path)) from None
    except ValueError as exc:
        raise UserError(f"not valid JSON: {exc}", file=str(path)) from None
    return parse_global_router(data, str(path))


def parse_global_router(data: Any, where: str) -> GlobalRouterConfig:
    config = parse_model(GlobalRouterConfig, data, file=where)
    problem = check(config)
    if problem:
        field, message = problem
        raise UserError(message, file=where, field=field)
    return config


def check(c: GlobalRouterConfig) -> tuple[str, str] | None:
    """The first inconsistency as (field, message), or None."""
    for kind in c.kinds():
        count, names = getattr(c, f"num_{kind}_pools"), getattr(c, f"{kind}_pool_dynamo_namespaces")
        grid = getattr(c, f"{kind}_pool_selection_strategy")
        for field, value in ((f"num_{kind}_pools", count), (f"{kind}_pool_dynamo_namespaces", names),
                             (f"{kind}_pool_selection_strategy", grid)):
            if value is None:
                return field, f"required in {c.mode} mode"
        if count < 1:
            return f"num_{kind}_pools", f"must be at least 1, got {count}"
        if len(names) != count:
            return f"{kind}_pool_dynamo_namespaces", f"{len(names)} names for num_{kind}_pools {count}"
        prio = getattr(c, f"{kind}_pool_priorities")
        if prio is not None and len(prio) != count:
            return f"{kind}_pool_priorities", f"{len(prio)} priorities for num_{kind}_pools {count}"
        problem = _check_grid(kind, grid, count)
        if problem:
            return f"{kind}_pool_selection_strategy.{problem[0]}", problem[1]
    return None


def _check_grid(kind: str, g: Any, pools: int) -> tuple[str, str] | None:
    axes = {"prefill": [("isl", "isl_min", "isl_max"), ("ttft", "ttft_min_ms", "ttft_max_ms")],
            "decode": [("context_length", "context_length_min", "context_length_max"),
                       ("itl", "itl_min_ms", "itl_max_ms")],
            "agg": [("ttft", "ttft_min_ms", "ttft_max_ms"), ("itl", "itl_min_ms", "itl_max_ms")]}[kind]
    if kind == "agg":
        given = [g.isl_min is not None, g.isl_max is not None, g.isl_resolution is not None]
        if any(given) and not all(given):
            return "isl_resolution", "isl_min, isl_max and isl_resolution go together"
        if all(given):
            axes = [("isl", "isl_min", "isl_max"), *axes]
    for name, low, high in axes:
        resolution = getattr(g, f"{name}_resolution")
        if resolution < 1:
            return f"{name}_resolution", f"must be at least 1, got {resolution}"
        if getattr(g, low) >= getattr(g, high):
            return low, f"{low} {getattr(g, low)} must be below {high} {getattr(g, high)}"
    mapping_field = f"{kind}_pool_mapping"

    def walk(node: Any, depth: int, path: str) -> tuple[str, str] | None:
        want = getattr(g, f"{axes[depth][0]}_resolution")
        if not isinstance(node, list) or len(node) != want:
            size = len(node) if isinstance(node, list) else "not a list"
            return path, f"{size} entries where {axes[depth][0]}_resolution is {want}"
        for i, item in enumerate(node):
            if depth + 1 < len(axes):
                problem = walk(item, depth + 1, f"{path}[{i}]")
                if problem:
                    return problem
            elif not isinstance(item, int) or not 0 <= item < pools:
                return f"{path}[{i}]", f"pool {item} does not exist (pools 0 to {pools - 1})"
        return None
    problem = walk(getattr(g, mapping_field), 0, mapping_field)
    if problem:
        return problem
    for i, rule in enumerate(g.priority_overrides):
        if rule.min_priority > rule.max_priority:
            return f"priority_overrides[{i}]", f"min_priority {rule.min_priority} above max_priority " \
                                               f"{rule.max_priority}"
        if not 0 <= rule.target_pool < pools:
            return f"priority_overrides[{i}].target_pool", f"pool {rule.target_pool} does not exist " \
                                                           f"(pools 0 to {pools - 1})"
    return None
