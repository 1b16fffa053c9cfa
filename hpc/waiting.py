"""One way to wait: poll a check with backed-off delays until it answers or a deadline passes.

Replaces the hand-written `while ...: time.sleep(...)` loops. Slurm is asked on submitit's schedule (its
InfoWatcher: 0, 2, 4, 8 s ... capped) so a long launch does not hammer the controller; local files are cheap and
are polled fast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    first_s: float = 0.01
    factor: float = 1.5
    cap_s: float = 0.25

    def delays(self) -> Iterator[float]:
        delay = self.first_s
        while True:
            yield delay
            delay = min(delay * self.factor, self.cap_s)


FAST = Backoff()  # local files and loopback probes
SLURM = Backoff(first_s=2.0, factor=2.0, cap_s=8.0)  # the controller: now, then 2, 4, 8, 8 ... s


class Throttle:
    """Whether it is time to ask again, on a backoff schedule: for loops that poll several things at their own
    pace (readiness files fast, Slurm slowly). The first ask is immediate."""

    def __init__(self, backoff: Backoff = SLURM, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.delays = backoff.delays()
        self.next_at = clock()

    def due(self) -> bool:
        now = self.clock()
        if now < self.next_at:
            return False
        self.next_at = now + next(self.delays)
        return True


def wait_until(check: Callable[[], T | None], timeout_s: float, what: str, backoff: Backoff = FAST,
               sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> T:
    """The first answer of `check` that is neither None nor False (a check written as a comparison waits too);
    TimeoutError naming `what` after `timeout_s`. `check` may raise to stop the wait early (a process that exited,
    a job that ended)."""
    deadline = clock() + timeout_s
    for delay in backoff.delays():
        answer = check()
        if answer is not None and answer is not False:
            return answer
        remaining = deadline - clock()
        if remaining <= 0:
            raise TimeoutError(f"{what}: no answer in {timeout_s:.0f} s")
        sleep(min(delay, remaining))
    raise AssertionError("unreachable")  # delays() never ends
