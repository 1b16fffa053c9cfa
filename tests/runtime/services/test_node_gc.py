"""The garbage collector's clock that each served process reports (/metrics): what it counts is what ran."""

from __future__ import annotations

import gc

import pytest

from hpc.runtime.services.node import GcClock, watch_gc

pytestmark = pytest.mark.unit


def test_a_full_collection_is_counted_with_its_time():
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        gc.collect(0)
        gc.collect()
    finally:
        gc.callbacks.remove(clock)
    assert clock.collections == [1, 0, 1]
    stats = clock.stats("engine_")
    assert stats["engine_gc_full_collections_total"] == 1
    assert 0 < stats["engine_gc_full_seconds_total"] <= stats["engine_gc_seconds_total"] < 5


def test_one_clock_a_process_however_often_it_is_asked_for():
    first = watch_gc()
    assert watch_gc() is first and gc.callbacks.count(first) == 1
    before = first.collections[2]
    gc.collect()
    assert first.collections[2] == before + 1
