"""What hpc cancel says of its drain: how long the workers took, at once when nothing was in flight, or who was
still serving when the grace period ended."""

from __future__ import annotations

import time

import pytest

from hpc.cli.runtime_commands import DrainWatch

pytestmark = pytest.mark.unit


class ServingRun:
    """A run whose workers still serve for the first `polls` looks."""

    def __init__(self, polls: int, serving: list[str]) -> None:
        self.polls, self.serving = polls, serving

    def workers_serving(self) -> list[str]:
        self.polls -= 1
        return self.serving if self.polls >= 0 else []


def test_a_drain_with_nothing_in_flight_says_so_not_zero_seconds():
    watch = DrainWatch(ServingRun(0, []))
    assert watch() is True
    assert watch.summary(30) == " (workers drained at once: nothing was in flight)"


def test_a_drain_that_took_time_says_how_long():
    watch = DrainWatch(ServingRun(1, ["agg-0"]))
    assert watch() is False
    time.sleep(0.2)
    assert watch() is True
    took = float(watch.summary(30).split("drained in ")[1].split(" s")[0])
    assert 0.1 <= took < 5


def test_a_grace_period_that_ended_names_who_was_still_serving():
    watch = DrainWatch(ServingRun(10, ["agg-0", "agg-1"]))
    assert watch() is False
    assert watch.summary(0.5) == ("\nthe grace period (0.5 s) ended with agg-0, agg-1 still serving: what they held "
                                  "was cut (a longer --grace lets it finish)")
    assert DrainWatch(ServingRun(0, [])).summary(30) == ""  # never polled: nothing was serving to drain
