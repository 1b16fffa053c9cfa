"""Discovery: workers register with a lease; the frontend watches. etcd (aetcd) or a shared-file store."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from hpc.manifest import Manifest

log = logging.getLogger(__name__)
LEASE_TTL_S = 1  # with etcd's 50 ms heartbeat (see infra.py) a dead worker's key is gone within ~1.5 s
FILE_STALE_S = 1.5


class Instance(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    role: str
    index: int
    pool: str = ""  # the role's pool (frontend.global_router), "" without pools
    instance_id: str
    host: str
    rpc_port: int
    http_port: int
    node: str
    # Leaving: no new requests, but its connections stay for what it still serves (and for KV fetches and
    # releases of what it prefilled). A key that goes away instead is a worker gone or hung.
    draining: bool = False
    # attention-DP ranks, each with a KV cache of its own (TensorRT-LLM's enable_attention_dp): a cache-aware
    # router picks the rank too, and the engine schedules the request there
    dp_size: int = Field(default=1, ge=1, le=1024)

    @property
    def key(self) -> str:
        return f"{self.role}/{self.index}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"


Snapshot = dict[str, Instance]  # key -> instance


class EtcdDiscovery:
    def __init__(self, host: str, port: int, prefix: str, password: str | None = None) -> None:
        self.host, self.port, self.prefix = host, port, prefix
        self.password = password
        self._client = None
        self._lease = None
        self._instance: Instance | None = None  # as registered (and re-registered after a lost lease)
        self._tasks: list[asyncio.Task] = []

    async def _connect(self):
        import aetcd

        if self._client is None:
            auth: dict[str, Any] = {"username": "root", "password": self.password} if self.password else {}
            self._client = aetcd.Client(host=self.host, port=self.port, timeout=5, **auth)
            await self._client.connect()
        return self._client

    async def register(self, instance: Instance) -> None:
        self._instance = instance
        await self._put()
        self._tasks.append(asyncio.create_task(self._keepalive()))

    async def set_draining(self) -> None:
        """Stay listed, as draining, under the same lease: routers stop sending work but keep the connection."""
        assert self._instance is not None, "register first"
        self._instance = self._instance.model_copy(update={"draining": True})
        await self._write()

    async def _put(self) -> None:
        """A new lease, and the key under it."""
        client = await self._connect()
        self._lease = await client.lease(LEASE_TTL_S)
        await self._write()

    async def _write(self) -> None:
        client = await self._connect()
        if self._instance is None or self._lease is None:
            raise RuntimeError("register first")
        await client.put((self.prefix + self._instance.key).encode(), self._instance.model_dump_json().encode(),
                         lease=self._lease)

    async def _keepalive(self) -> None:
        registered = True
        while True:
            await asyncio.sleep(LEASE_TTL_S / 4)
            try:
                if registered and self._lease is not None:
                    reply = await self._lease.refresh()
                    if reply is None or reply.TTL <= 0:  # expired while we were stopped or cut off: come back
                        log.warning("lease expired; registering again")
                        registered = False
                if not registered:
                    # a new lease *and* the key under it: a lease granted before a failed put refreshes fine
                    # but announces nothing, so the put is retried until it lands
                    await self._put()
                    registered = True
            except Exception as exc:  # etcd gone, slow or restarted: keep trying; the lease may expire meanwhile
                log.warning("lease refresh or registration failed: %s", exc)
                # Next round: a fresh connection, a new lease and the key again. A restarted etcd has forgotten
                # this client's auth token ("invalid auth token" on every call until it authenticates again);
                # re-putting the key under a new lease is harmless if the old one was still alive.
                registered = False
                await self._reconnect()

    async def _reconnect(self) -> None:
        old, self._client = self._client, None
        if old is not None:
            try:
                await old.close()
            except Exception:
                pass

    async def deregister(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._lease is not None:
            try:
                await self._lease.revoke()
            except Exception:
                pass

    async def snapshot(self) -> Snapshot:
        return (await self._snapshot_at())[0]

    async def _snapshot_at(self) -> tuple[Snapshot, int]:
        """The registered instances and the store revision they were read at."""
        client = await self._connect()
        result = await client.get_prefix(self.prefix.encode())
        out = {}
        for kv in result:
            inst = Instance.model_validate_json(kv.value)
            out[inst.key] = inst
        return out, result.header.revision

    async def watch(self, on_change: Callable[[Snapshot], None]) -> None:
        """Call on_change with every new snapshot, forever (reconnecting after errors)."""
        from aetcd.rtypes import EventKind

        while True:
            try:
                client = await self._connect()
                current, revision = await self._snapshot_at()
                on_change(dict(current))
                # from the revision after the snapshot: a worker that registers between the read and the watch
                # is an event of the watch, not lost (it refreshes its lease, which puts nothing)
                watch = await client.watch_prefix(self.prefix.encode(), start_revision=revision + 1)
                async for event in watch:
                    key = event.kv.key.decode()[len(self.prefix):]
                    if event.kind == EventKind.PUT:
                        current[key] = Instance.model_validate_json(event.kv.value)
                    else:
                        current.pop(key, None)
                    on_change(dict(current))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("etcd watch failed (%s); retrying", exc)
                await self._reconnect()
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        await self.deregister()
        if self._client is not None:
            try:
                await self._client.close()
            except Exception:
                pass


class FileDiscovery:
    """Shared-directory store: one file per instance, its mtime the heartbeat."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._task: asyncio.Task | None = None
        self._path: Path | None = None
        self._instance: Instance | None = None

    async def register(self, instance: Instance) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._path = self.dir / f"{instance.role}-{instance.index}.json"
        self._instance = instance
        self._write()
        self._task = asyncio.create_task(self._heartbeat())

    async def set_draining(self) -> None:
        assert self._instance is not None, "register first"
        self._instance = self._instance.model_copy(update={"draining": True})
        self._write()

    def _write(self) -> None:
        if self._path is None or self._instance is None:
            raise RuntimeError("register first")
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(self._instance.model_dump_json())
        os.replace(tmp, self._path)

    async def _heartbeat(self) -> None:
        while self._path is not None:
            await asyncio.sleep(FILE_STALE_S / 5)
            try:
                os.utime(self._path)
            except FileNotFoundError:
                return

    async def deregister(self) -> None:
        if self._task:
            self._task.cancel()
        if self._path:
            self._path.unlink(missing_ok=True)

    async def snapshot(self) -> Snapshot:
        out = {}
        now = time.time()
        for path in self.dir.glob("*.json") if self.dir.is_dir() else []:
            try:
                if now - path.stat().st_mtime > FILE_STALE_S:
                    continue
                inst = Instance.model_validate(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
            out[inst.key] = inst
        return out

    async def watch(self, on_change: Callable[[Snapshot], None]) -> None:
        last = None
        while True:
            snap = await self.snapshot()
            if snap != last:
                on_change(dict(snap))
                last = snap
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self.deregister()


def open_discovery(manifest: Manifest, timeout: float = 600.0):
    """The store the cluster profile names; waits for etcd to publish its endpoint."""
    if manifest.cluster.discovery == "file" or not manifest.recipe.infra.etcd:
        return FileDiscovery(Path(manifest.run_dir) / "discovery")
    from hpc.runtime.services.node import etcd_password, wait_endpoint

    ep = wait_endpoint(manifest, "etcd", timeout)
    return EtcdDiscovery(ep.host, ep.port, f"/hpc/{manifest.run_id}/instances/", etcd_password(manifest))
