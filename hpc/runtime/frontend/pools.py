"""The global router in the request path (seed 003): which pool of a role serves a request, and why.

The grid and the priority rules are GlobalRouterConfig's (hpc/spec/global_router.py); here they meet the request:
its input length, the SLA targets it sent (`extra_args` / `nvext.router`) and `nvext.agent_hints.priority`. The
answer is an order: the chosen pool, then (enable_priority_retry) the faster pools a request that failed before its
first byte moves on to. Every decision is counted by role, pool and reason for /metrics and `hpc status`.
"""

from __future__ import annotations

from typing import Any

from hpc.runtime.frontend.openai import RouteHints
from hpc.spec.global_router import GlobalRouterConfig, parse_global_router


class PoolRouter:
    def __init__(self, config: GlobalRouterConfig) -> None:
        self.config = config
        self.decisions: dict[tuple[str, str, str], int] = {}  # (role, pool, reason) -> requests

    @classmethod
    def from_recipe(cls, inline: str | dict[str, Any] | None) -> "PoolRouter | None":
        """The manifest's recipe carries the config inline (resolve loaded and checked it): a path here is a
        manifest not written by resolve."""
        if isinstance(inline, str):
            raise ValueError(f"frontend.global_router is the path {inline!r}, not the config resolve puts inline")
        return None if inline is None else cls(parse_global_router(inline, "manifest: frontend.global_router"))

    def prefill(self, isl: int, hints: RouteHints) -> list[str]:
        c = self.config
        return self._decide("prefill", c.prefill_pool(isl, hints.ttft_ms, hints.priority), hints)

    def decode(self, context_length: int, hints: RouteHints) -> list[str]:
        """Context length is the prompt's, as Dynamo's global router reads it (the decode request's tokens)."""
        c = self.config
        return self._decide("decode", c.decode_pool(context_length, hints.itl_ms, hints.priority), hints)

    def agg(self, isl: int, hints: RouteHints) -> list[str]:
        c = self.config
        return self._decide("agg", c.agg_pool(hints.ttft_ms, hints.itl_ms, hints.priority, isl), hints)

    def _decide(self, kind: str, chosen: int, hints: RouteHints) -> list[str]:
        if hints.priority is not None and self.config.overridden(kind, hints.priority):
            reason = "priority"
        else:
            reason = "grid" if hints.ttft_ms is not None or hints.itl_ms is not None else "grid_default_target"
        names = self.config.pools(kind)
        key = (kind, names[chosen], reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        return [names[i] for i in self.config.retry_order(kind, chosen)]
