"""A worker's registration outlives etcd's faults: a lapsed lease, a restarted etcd that no longer accepts the
client's auth token, calls that fail for a while. A small fake etcd stands in for the server."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from hpc.runtime.services import discovery as discovery_mod
from hpc.runtime.services.discovery import EtcdDiscovery, Instance

pytestmark = pytest.mark.unit


class FakeEtcdServer:
    def __init__(self) -> None:
        self.keys: dict[bytes, int] = {}  # key -> lease id
        self.leases: set[int] = set()
        self.tokens: set[int] = set()
        self.ids = itertools.count(1)

    def restart_and_expire(self) -> None:
        """etcd restarted (tokens forgotten) and every lease lapsed meanwhile (their keys with them)."""
        self.tokens.clear()
        self.leases.clear()
        self.keys.clear()


class FakeLease:
    def __init__(self, client: "FakeClient", lease_id: int) -> None:
        self.client, self.id = client, lease_id

    async def refresh(self):
        self.client.check()
        return type("Reply", (), {"TTL": 1 if self.id in self.client.server.leases else 0})()

    async def revoke(self) -> None:
        self.client.server.leases.discard(self.id)


class FakeClient:
    def __init__(self, server: FakeEtcdServer) -> None:
        self.server = server
        self.token = next(server.ids)
        server.tokens.add(self.token)  # authenticated on connect, as aetcd does once per client

    def check(self) -> None:
        if self.token not in self.server.tokens:
            raise RuntimeError("etcdserver: invalid auth token")

    async def lease(self, ttl: int) -> FakeLease:
        self.check()
        lease_id = next(self.server.ids)
        self.server.leases.add(lease_id)
        return FakeLease(self, lease_id)

    async def put(self, key: bytes, value: bytes, lease: FakeLease) -> None:
        self.check()
        self.server.keys[key] = lease.id

    async def close(self) -> None:
        pass


class FakeEtcdDiscovery(EtcdDiscovery):
    def __init__(self, server: FakeEtcdServer) -> None:
        super().__init__("127.0.0.1", 2379, "/hpc/run/instances/", password="p")
        self.server = server
        self.connects = 0

    async def _connect(self):
        if self._client is None:
            self._client = FakeClient(self.server)
            self.connects += 1
        return self._client


def test_registration_comes_back_after_a_restart_forgot_the_token_and_the_lease_lapsed(monkeypatch):
    monkeypatch.setattr(discovery_mod, "LEASE_TTL_S", 0.2)
    server = FakeEtcdServer()
    worker = FakeEtcdDiscovery(server)
    instance = Instance(role="prefill", index=0, instance_id="p0", host="127.0.0.1", rpc_port=1, http_port=2,
                        node="n0")

    async def main() -> None:
        await worker.register(instance)
        assert list(server.keys) == [b"/hpc/run/instances/prefill/0"]
        server.restart_and_expire()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if server.keys:
                break
        assert list(server.keys) == [b"/hpc/run/instances/prefill/0"]  # registered again, under a live lease
        assert server.keys[b"/hpc/run/instances/prefill/0"] in server.leases
        assert worker.connects == 2  # through a fresh, authenticated connection
        await worker.close()

    asyncio.run(main())


def test_the_file_store_lists_a_draining_worker_as_draining(tmp_path):
    async def main():
        store = discovery_mod.FileDiscovery(tmp_path)
        await store.register(Instance(role="decode", index=1, instance_id="d1", host="h", rpc_port=1, http_port=2,
                                      node="n0"))
        before = await store.snapshot()
        await store.set_draining()
        after = await store.snapshot()
        await store.close()
        return before, after, await store.snapshot()

    before, after, closed = asyncio.run(main())
    assert before["decode/1"].draining is False and after["decode/1"].draining is True
    assert after["decode/1"].instance_id == "d1" and closed == {}
