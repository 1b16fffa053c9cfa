"""Plain-text tables for the CLI (no dependencies, works on any login node)."""

from __future__ import annotations

from typing import Sequence

from hpc.plan.placement import Plan


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def _span(nodes: list[int]) -> str:
    return f"n{nodes[0]}" if len(nodes) == 1 else f"n{nodes[0]}-n{nodes[-1]}"


def plan_table(plan: Plan, title: str) -> str:
    rows: list[list[object]] = []
    for s in plan.services:
        name = f"{s.name} ({s.processes} processes)" if s.processes > 1 else s.name
        rows.append([f"n{s.node}", name, 1, "-", " ".join(f"{k}={v}" for k, v in s.ports.items())])
    for w in plan.workers:
        name = f"{w.name} ({w.pool})" if w.pool else w.name
        rows.append([_span(w.nodes), name, w.tasks, w.gpu_text(), " ".join(f"{k}={v}" for k, v in w.ports.items())])
    body = table(["NODE", "COMPONENT", "TASKS", "GPUS", "PORTS"], rows)
    return f"{title}\n{body}\nreadiness: {' -> '.join(plan.readiness_order)}"
