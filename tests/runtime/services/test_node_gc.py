"""The garbage collector's clock that each served process reports (/metrics): what it counts is what ran."""

from __future__ import annotations

import gc
import time

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


def test_the_loop_latency_is_what_a_callback_made_ready_waits_behind_the_loops_work(monkeypatch):
    """Idle, a probe runs at once; while the loop always has a callback ready that holds it 1 ms (a stream of
    frames to handle), a probe waits behind one."""
    import asyncio

    from hpc.runtime.services.node import LoopLatency

    monkeypatch.setattr(LoopLatency, "INTERVAL_S", 0.002)

    async def run(busy: bool) -> tuple[float, int]:
        latency = LoopLatency().start()
        loop = asyncio.get_running_loop()
        # busy past the probes' last (0.25 s): probes after the work stopped waited for nothing, and brought the
        # busy mean to 0.78 ms in a CI run
        until = time.perf_counter() + 0.35

        def work() -> None:
            time.sleep(0.001)
            if time.perf_counter() < until:
                loop.call_soon(work)
        if busy:
            loop.call_soon(work)
        await asyncio.sleep(0.25)
        latency.stop()
        stats = latency.stats("x_")
        return stats["x_loop_latency_seconds_total"], stats["x_loop_latency_probes_total"]

    idle_s, idle_probes = asyncio.run(run(False))
    busy_s, busy_probes = asyncio.run(run(True))
    assert idle_probes > 20 and idle_s / idle_probes < 0.0003, (idle_s, idle_probes)
    assert busy_probes > 20 and busy_s / busy_probes > 0.0008, (busy_s, busy_probes)


def test_the_frozen_objects_are_counted_once_at_the_freeze_never_in_an_engines_stats(monkeypatch):
    """gc.get_freeze_count() walks every frozen object with the GIL held (tens of ms in an engine process): read
    once at the freeze; an engine process's stats(), made every second, only repeat it."""
    import asyncio
    import types

    from hpc.runtime.engine.types import DisaggregationMode
    from hpc.runtime.services.node import freeze_startup_objects
    from hpc.runtime.worker.engine_core import Core

    walks = []
    real = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: walks.append(1) or real())
    try:
        frozen = freeze_startup_objects()
    finally:
        gc.unfreeze()
    assert frozen > 1000 and walks == [1]

    async def made() -> tuple[dict, dict]:
        engine = types.SimpleNamespace(mode=DisaggregationMode.AGGREGATED, stats=lambda: {"requests": 3},
                                       core=types.SimpleNamespace(emitter=None))
        core = Core(engine, types.SimpleNamespace(send=lambda message: None),
                    types.SimpleNamespace(counters={}, attach_shared=None), GcClock())
        core.frozen_objects = frozen
        return core.stats(), core.timing

    stats, timing = asyncio.run(made())
    assert walks == [1] and stats["engine_gc_frozen_objects"] == frozen and stats["requests"] == 3
    assert timing["stats_made_total"] == 1 and 0 <= timing["stats_cpu_seconds_total"] < 0.01
