"""KV transfers by prefill -> decode pair: what timed out where, and which pairs sit out.

A transfer past its deadline (the decode's 504, hpc.runtime.worker.kv_handoff) says that this pair's route is
slow or broken (a wrong UCX interface, a blackholed route between two nodes), not that either worker is: both
may serve every other partner. So the pair, not a worker, leaves routing: after `bench_after` timeouts in a row
the decode is not picked for that prefill's KV for `cooldown_s`, then one request may try again (a success puts
the pair back; another timeout benches it again, for twice as long, up to `MAX_COOLDOWN_S`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

MAX_COOLDOWN_S = 600.0


@dataclass
class PairRecord:
    timeouts: int = 0  # in all
    in_a_row: int = 0
    retried: int = 0  # requests that went on to another pair after this one timed out
    benched_until: float = 0.0
    cooldown_s: float = 0.0


class PairHealth:
    def __init__(self, bench_after: int = 2, cooldown_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bench_after, self.cooldown_s, self.clock = bench_after, cooldown_s, clock
        self.pairs: dict[tuple[str, str], PairRecord] = {}

    def failed(self, prefill: str, decode: str, retried: bool) -> bool:
        """A transfer of this pair passed its deadline; True when the pair now sits out."""
        rec = self.pairs.setdefault((prefill, decode), PairRecord())
        rec.timeouts += 1
        rec.in_a_row += 1
        rec.retried += int(retried)
        if rec.in_a_row < self.bench_after:
            return False
        rec.cooldown_s = min(MAX_COOLDOWN_S, rec.cooldown_s * 2 if rec.cooldown_s else self.cooldown_s)
        rec.benched_until = self.clock() + rec.cooldown_s
        return True

    def succeeded(self, prefill: str, decode: str) -> None:
        rec = self.pairs.get((prefill, decode))
        if rec is not None:
            rec.in_a_row, rec.cooldown_s, rec.benched_until = 0, 0.0, 0.0

    def benched(self, prefill: str) -> set[str]:
        """The decode workers that sit out for `prefill`'s KV now."""
        now = self.clock()
        return {d for (p, d), rec in self.pairs.items() if p == prefill and rec.benched_until > now}

    def view(self) -> list[dict[str, Any]]:
        """Every pair with a timeout, for /health and hpc status."""
        now = self.clock()
        return [{"prefill": p, "decode": d, "timeouts": rec.timeouts, "in_a_row": rec.in_a_row, "retried": rec.retried,
                 "benched_s": round(max(0.0, rec.benched_until - now), 1)}
                for (p, d), rec in sorted(self.pairs.items()) if rec.timeouts]
