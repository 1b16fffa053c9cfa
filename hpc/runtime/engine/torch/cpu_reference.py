"""How fast the CPU under a thread runs now, from a fixed piece of interpreter work timed on it.

On the VMs we test on, a vCPU's speed halves and comes back within a minute (docs/performance-log.md, session 24), and
a decode engine's step at high concurrency is the host's time: a slower level of a benchmark may be a slower CPU,
not slower code. The scheduler times the reference a few times a second on its own thread while it decodes (a few
tens of µs each: a ten-thousandth of its time; a thread just woken from a wait for work reads up to 2x slower, its
caches cold), and /metrics carries the sum and the count, so that a benchmark can put the CPU's speed beside each
level's figures.
"""

from __future__ import annotations

import time


class _Row:
    value = 0


def reference_seconds(rounds: int) -> float:
    """What a decode step does per row, `rounds` times (attribute reads and writes, a comparison, a list append),
    timed."""
    row, out = _Row(), []
    began = time.perf_counter()
    for i in range(rounds):
        row.value = row.value + 1
        if i < row.value:
            out.append(i)
    return time.perf_counter() - began


class CpuReference:
    """The reference timed on the calling thread every EVERY_S at most; `stats` for /metrics."""

    EVERY_S = 0.2
    ROUNDS = 500

    def __init__(self) -> None:
        self.seconds = 0.0
        self.runs = 0
        self._next = 0.0

    def maybe_run(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.EVERY_S
        self.seconds += reference_seconds(self.ROUNDS)
        self.runs += 1

    def stats(self) -> dict[str, float]:
        return {"scheduler_cpu_reference_seconds_total": self.seconds,
                "scheduler_cpu_reference_runs_total": self.runs}
