"""A serving worker's life once its engine is loaded: its HTTP answers, then the wait for a stop, a drain or the
engine's failure, and the closing of what it opened (serve.py opens them)."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Any, Callable

from hpc.runtime.engine.types import Engine
from hpc.runtime.serve.http import Request, Response, json_response
from hpc.runtime.serve.metrics import prometheus
from hpc.runtime.services.node import Reporter
from hpc.runtime.worker.engine_process import engine_stats

log = logging.getLogger("hpc.worker")


@dataclass
class WorkerHttp:
    """/health, /live and /metrics of one worker."""

    engine: Engine
    counters: dict[str, float]
    role: str
    index: int
    labels: dict[str, str]
    inflight: Callable[[], int]
    clocks: list[Any]  # each has stats(prefix): the GC clock, the loop's latency, the idle spin
    draining: bool = False
    frozen_objects: int = 0  # start-up's objects out of the collector's view, counted once

    async def __call__(self, req: Request) -> Response:
        if req.path in ("/health", "/live"):
            return self._health()
        if req.path == "/metrics":
            stats = {**await engine_stats(self.engine), **self.counters, "inflight": self.inflight(),
                     "gc_frozen_objects": self.frozen_objects}
            for clock in self.clocks:
                stats.update(clock.stats("worker_"))
            return Response(body=prometheus("hpc_worker", stats, self.labels),
                            content_type="text/plain; version=0.0.4")
        return json_response({"error": {"message": "not found", "code": 404}}, 404)

    def _health(self) -> Response:
        failure = self.engine.failure
        if failure:
            return json_response({"status": "failed", "error": failure, "role": self.role, "index": self.index}, 503)
        counted = {**self.engine.stats(), **self.counters}  # an engine process fetches the KV itself
        fetched = {key.removeprefix("kv_fetched_"): int(n) for key, n in counted.items()
                   if key.startswith("kv_fetched_") and n}  # which transport the KV came by, so far
        return json_response({"status": "draining" if self.draining else "ready", "role": self.role,
                              "index": self.index, **({"kv_fetched": fetched} if fetched else {})},
                             503 if self.draining else 200)


@dataclass
class Opened:
    """What a serving worker opened, closed in the order that lets releases on their way still leave."""

    rpc: Any
    web: Any
    discovery: Any
    peers: Any
    handoff: Any
    events: Any = None
    watch_task: asyncio.Task | None = None

    async def close(self) -> None:
        if self.watch_task:
            self.watch_task.cancel()
        await self.handoff.settle()  # KV releases on their way to prefill workers leave before the connections close
        await self.rpc.close()
        await self.web.close()
        await self.discovery.close()
        await self.peers.close()
        if self.events is not None:
            await self.events.close()


async def _engine_failed(engine: Engine) -> None:
    while not engine.failure:
        await asyncio.sleep(0.2)


async def until_stopped(engine: Engine, opened: Opened, http: WorkerHttp, reporter: Reporter,
                        restarting: bool) -> int:
    """Serve until TERM/INT (0), or the engine's failure (1); USR1 (hpc cancel's first tier) drains first: leave
    routing, finish what is in flight, then wait for TERM."""
    stop, drain = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, drain.set)
    failed = asyncio.create_task(_engine_failed(engine))
    await asyncio.wait([asyncio.create_task(stop.wait()), asyncio.create_task(drain.wait()), failed],
                       return_when=asyncio.FIRST_COMPLETED)
    if failed.done():
        # A dead engine must not look alive: leave routing, report, and exit non-zero so the role's failure
        # policy (restart / continue / fail the job) applies.
        log.error("engine failed: %s", engine.failure)
        reporter.phase("failed", error=f"engine failed: {engine.failure}", restarting=restarting)
        await opened.discovery.deregister()
        await opened.close()
        return 1
    failed.cancel()
    http.draining = True
    reporter.phase("draining")
    try:  # no new requests are routed here; what is in flight keeps its connections
        await opened.discovery.set_draining()
    except Exception as exc:  # discovery unreachable: leave it, at the cost of the frontends' connections
        log.warning("could not mark this worker draining (%s): deregistering", exc)
        await opened.discovery.deregister()
    # "drained" only once nothing is in flight: hpc cancel's grace period (or the job's end) bounds the wait, and a
    # stream longer than any fixed limit here must not be reported finished while it still runs
    while http.inflight() and not stop.is_set():
        await asyncio.sleep(0.05)
    if not stop.is_set():
        reporter.phase("drained")
        await stop.wait()
    await opened.close()
    return 0
