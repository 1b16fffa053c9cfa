"""Plain-text tables for the CLI (no dependencies, works on any login node)."""

from __future__ import annotations

from typing import Sequence

from hpc.plan.placement import Plan


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], width: int | None = None) -> str:
    """`width`: a terminal's columns, which the last column's text is cut to (ending in "…") instead of
    wrapping under the first; None (a pipe, a file) keeps every cell whole."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    if width:
        lines = [line if len(line) <= width else line[:max(width - 1, 1)] + "…" for line in lines]
    return "\n".join(lines)


def terminal_width() -> int | None:
    """The terminal's columns when standard output is one; None otherwise."""
    import shutil
    import sys

    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


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
