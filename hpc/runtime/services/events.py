"""Event plane on NATS: KV-cache events and load metrics from each worker (nats-py).

A router that starts after the workers (a frontend restarted by its supervisor, another frontend process, or one
whose NATS connection came back) missed the stored events of everything they cache. It asks for a resync on the
`kv_resync` subject; each worker answers on its own event subject, in order with its live events, with "cleared"
and then every block it holds (`KvMirror`: the worker keeps what it published, for TensorRT-LLM has no call that
lists its cache). A worker whose own connection came back resends unasked.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from typing import Any, Callable

import msgspec

from hpc.manifest import Manifest
from hpc.runtime.services.node import nats_token, wait_endpoint

log = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()


def subject(manifest: Manifest, kind: str, component: str) -> str:
    return f"hpc.{manifest.run_id}.{kind}.{component}".replace("-", "_")


_TOKEN_ID = operator.itemgetter("token_id")  # a third faster than a generator: the worker notes every prompt
RESYNC_RECORD_TOKENS = 16384  # a resync record's tokens at most: ~100 kB of JSON, well under NATS's 1 MB limit


def block_mm_keys(block: dict) -> tuple[str, ...]:
    """The multimodal hashes TensorRT-LLM records with a stored block whose tokens belong to an image
    (KVCacheEventSerializer: `mm_keys`, each {"type": "mm_key", "hash": hex, "start_offset": n}): an image's
    placeholder tokens are the same for every image, its hash is what tells them apart."""
    return tuple(str(k.get("hash", "")) for k in block.get("mm_keys") or () if k.get("type") == "mm_key" and k.get("hash"))



class KvMirror:
    """The blocks a worker's engine holds, from the TensorRT-LLM-shaped records it published: engine block hash ->
    (its parent's hash, its tokens). Shapes as tensorrt_llm/_utils.py KVCacheEventSerializer writes them; its
    `created` and `updated` records (pool sizes, a block's priority or cache level) add or drop no block."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.mm: dict[int, tuple[str, ...]] = {}  # blocks that cover an image: its hashes (few; kept apart)
        self.window = 0

    def note(self, record: dict[str, Any]) -> None:
        data = record.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            parent = data.get("parent_hash")
            self.window = record.get("window_size") or self.window
            for blk in data.get("blocks") or []:
                self.blocks[blk["block_hash"]] = (parent, tuple(map(_TOKEN_ID, blk.get("tokens") or ())))
                if blk.get("mm_keys"):
                    self.mm[blk["block_hash"]] = block_mm_keys(blk)
                parent = blk["block_hash"]
        elif kind == "removed":
            for engine_hash in data.get("block_hashes") or ():
                self.blocks.pop(engine_hash, None)
                self.mm.pop(engine_hash, None)

    def clear(self) -> None:
        self.blocks.clear()
        self.mm.clear()

    def records(self) -> list[dict[str, Any]]:
        """Every block, each parent before its children, as "held" records: a chain that does not branch is one
        record (cut at RESYNC_RECORD_TOKENS tokens), its tokens one flat list. TensorRT-LLM's form, a dict per
        token, would make a worker holding 24k blocks of 32 tokens send 42 MB to every router; this is a tenth."""
        most = max(1, RESYNC_RECORD_TOKENS // max(1, self.window))
        children: dict[int | None, list[int]] = {}
        for h, (parent, _) in self.blocks.items():
            if parent is None or parent in self.blocks:  # a block whose parent went is out of any prompt's reach
                children.setdefault(parent, []).append(h)
        out: list[dict[str, Any]] = []
        starts: list[tuple[int | None, int]] = [(None, h) for h in reversed(children.get(None, []))]
        while starts:
            parent, h = starts.pop()
            run = [h]
            while len(children.get(h, ())) == 1 and len(run) < most:
                h = children[h][0]
                run.append(h)
            starts += [(h, child) for child in reversed(children.get(h, []))]
            record = {"parent_hash": parent, "block_hashes": run, "block": self.window,
                      "tokens": [t for b in run for t in self.blocks[b][1]]}
            mm = {str(i): list(self.mm[b]) for i, b in enumerate(run) if b in self.mm}
            if mm:  # the images' hashes of the blocks that cover one, by position in the run
                record["mm"] = mm
            out.append(record)
        return out


class EventPublisher:
    """Publishes without ever blocking serving: events are dropped while NATS is unreachable."""

    def __init__(self, manifest: Manifest, component: str) -> None:
        self.manifest = manifest
        self.component = component
        self.nc = None
        self._task: asyncio.Task | None = None
        # what each attention-DP rank's cache holds (None: an engine without attention-DP); each rank hashes its
        # blocks on its own (upstream tests/unittest/llmapi/test_llm_kv_cache_events.py: attention_dp_rank)
        self.mirrors: dict[int | None, KvMirror] = {None: KvMirror()}

    async def connect(self, timeout: float = 30.0) -> "EventPublisher":
        import nats

        ep = await asyncio.to_thread(wait_endpoint, self.manifest, "nats", timeout)
        self.nc = await nats.connect(ep.base_url(), token=nats_token(self.manifest), max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.5, connect_timeout=5, reconnected_cb=self._reconnected)
        await self.nc.subscribe(subject(self.manifest, "kv_resync", "all"), cb=self._resync)
        return self

    def kv_event(self, event: str, **data: Any) -> None:
        if event == "cleared":
            self.mirrors = {None: KvMirror()}
        self._publish("kv_events", {"event": event, "worker": self.component, "ts": time.time(), **data})

    def engine_kv_event(self, event: dict[str, Any]) -> None:
        """A record from TensorRT-LLM's get_kv_cache_events_async, as the engine gave it."""
        # noted even while NATS is away: it is what the engine holds
        self.mirrors.setdefault(event.get("attention_dp_rank"), KvMirror()).note(event)
        self._publish("kv_events", {"event": "engine", "worker": self.component, "ts": time.time(), "record": event})

    async def _reconnected(self) -> None:
        """NATS came back (a restart by its supervisor): what was published while it was away is lost to every
        router. A router back before this worker asked while it could not hear, so it resends unasked."""
        await self._resync(None)

    async def _resync(self, _msg) -> None:
        """A router asked for every block (one started late, or its NATS connection came back): on the events'
        own subject, so every router applies them in order with the live ones."""
        now = time.time()
        self._publish("kv_events", {"event": "cleared", "worker": self.component, "ts": now, "resync": True})
        for rank, mirror in self.mirrors.items():
            extra = {} if rank is None else {"attention_dp_rank": rank}
            for held in mirror.records():
                self._publish("kv_events", {"event": "held", "worker": self.component, "ts": now, **held, **extra})

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
