"""Event plane on NATS: KV-cache events and load metrics from each worker (nats-py)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import msgspec

from hpc.manifest import Manifest
from hpc.runtime.services.node import nats_token, wait_endpoint

log = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()


def subject(manifest: Manifest, kind: str, component: str) -> str:
    return f"hpc.{manifest.run_id}.{kind}.{component}".replace("-", "_")


class EventPublisher:
    """Publishes without ever blocking serving: events are dropped while NATS is unreachable."""

    def __init__(self, manifest: Manifest, component: str) -> None:
        self.manifest = manifest
        self.component = component
        self.nc = None
        self._task: asyncio.Task | None = None

    async def connect(self, timeout: float = 30.0) -> "EventPublisher":
        import nats

        ep = await asyncio.to_thread(wait_endpoint, self.manifest, "nats", timeout)
        self.nc = await nats.connect(ep["url"], token=nats_token(self.manifest), max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.5, connect_timeout=5)
        return self

    def kv_event(self, event: str, **data: Any) -> None:
        self._publish("kv_events", {"event": event, "worker": self.component, "ts": time.time(), **data})

    def engine_kv_event(self, event: dict[str, Any]) -> None:
        """A record from TensorRT-LLM's get_kv_cache_events_async, as the engine gave it."""
        self._publish("kv_events", {"event": "engine", "worker": self.component, "ts": time.time(), "record": event})

    def engine_stats(self, stat: dict[str, Any]) -> None:
        """A record from TensorRT-LLM's get_stats_async (iteration stats)."""
        self._publish("engine_stats", {"worker": self.component, "ts": time.time(), "record": stat})

    def _publish(self, kind: str, data: dict[str, Any]) -> None:
        if self.nc is None or not self.nc.is_connected:
            return
        payload = _JSON.encode(data)  # the same JSON as json.dumps, 20x faster: a prefill worker sends one per block
        asyncio.ensure_future(self.nc.publish(subject(self.manifest, kind, self.component), payload))

    def start_load_reports(self, stats: Callable[[], dict[str, float]], every_s: float = 1.0) -> None:
        async def loop() -> None:
            while True:
                self._publish("load", {"worker": self.component, "ts": time.time(), **stats()})
                await asyncio.sleep(every_s)

        self._task = asyncio.create_task(loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        if self.nc is not None:
            try:
                await self.nc.drain()
            except Exception:  # NATS already gone (the job's end): drain refuses, and the client would go on
                try:           # reconnecting until cancelled
                    await self.nc.close()
                except Exception:
                    pass
