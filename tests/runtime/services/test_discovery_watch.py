"""The frontend's view of discovery misses nobody: a worker that registers between the watcher's first read and
its watch (a worker's later lease refreshes put nothing) is still seen. Real etcd, no auth."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import pytest

from hpc.checks.probe import get_json
from hpc.runtime.services.binaries import etcd_binary
from hpc.runtime.services.discovery import EtcdDiscovery, Instance
from hpc.waiting import wait_until

pytestmark = pytest.mark.integration


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def etcd(tmp_path):
    client, peer = _free_ports(2)
    proc = subprocess.Popen([etcd_binary(), "--data-dir", str(tmp_path / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{client}",
                             "--advertise-client-urls", f"http://127.0.0.1:{client}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def healthy() -> bool | None:
        try:
            return get_json(f"http://127.0.0.1:{client}/health", 0.5)[0] == 200 or None
        except OSError:  # not listening yet
            return None
    wait_until(healthy, 30, "etcd")
    yield client
    proc.terminate()
    proc.wait(10)


def test_a_worker_registering_between_the_read_and_the_watch_is_seen(etcd):
    async def main() -> dict:
        watcher = EtcdDiscovery("127.0.0.1", etcd, "/hpc/race/")
        worker = EtcdDiscovery("127.0.0.1", etcd, "/hpc/race/")
        client = await watcher._connect()
        real_watch = client.watch_prefix
        instance = Instance(role="decode", index=0, instance_id="d0", host="127.0.0.1", rpc_port=1, http_port=2,
                            node="n0")

        async def watch_after_a_registration(*args, **kwargs):  # the race, made certain
            await worker.register(instance)
            return await real_watch(*args, **kwargs)
        client.watch_prefix = watch_after_a_registration
        seen: dict = {}
        task = asyncio.create_task(watcher.watch(lambda snap: seen.update(latest=snap)))
        for _ in range(50):
            if "decode/0" in seen.get("latest", {}):
                break
            await asyncio.sleep(0.05)
        task.cancel()
        await worker.close()
        await watcher.close()
        return seen.get("latest", {})

    assert list(asyncio.run(main())) == ["decode/0"]


def test_a_draining_worker_stays_listed_as_draining_under_its_lease_and_after_losing_it(etcd):
    """Draining is a state of the registration, not its end: kept alive by the same lease, and a registration
    that comes back after a lost lease comes back draining (not routable again)."""
    async def main() -> list[tuple[str, bool]]:
        watcher = EtcdDiscovery("127.0.0.1", etcd, "/hpc/drain/")
        worker = EtcdDiscovery("127.0.0.1", etcd, "/hpc/drain/")
        await worker.register(Instance(role="agg", index=0, instance_id="a0", host="127.0.0.1", rpc_port=1,
                                       http_port=2, node="n0"))
        seen: list[tuple[str, bool]] = []

        def record(snap) -> None:
            state = [(k, i.draining) for k, i in snap.items()]
            if not seen or seen[-1] != (state[0] if state else ("gone", False)):
                seen.append(state[0] if state else ("gone", False))
        task = asyncio.create_task(watcher.watch(record))
        await asyncio.sleep(0.5)
        await worker.set_draining()
        await asyncio.sleep(2.5)  # over two lease TTLs: refreshed, still listed
        await worker._lease.revoke()  # the lease lost (etcd restarted, a long pause): the key goes with it
        await asyncio.sleep(1.5)  # the keepalive registers again
        task.cancel()
        await worker.close()
        await watcher.close()
        return seen

    assert asyncio.run(main()) == [("agg/0", False), ("agg/0", True), ("gone", False), ("agg/0", True)]
