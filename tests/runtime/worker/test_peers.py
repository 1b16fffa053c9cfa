"""A worker's peers: one its discovery has not listed yet is waited for (workers register in any order), one that
was listed and left is refused at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from hpc.runtime.serve.rpc import RemoteError
from hpc.runtime.services.discovery import Instance
from hpc.runtime.worker.handlers import Peers

pytestmark = pytest.mark.unit


def _encode(draining: bool = False) -> dict[str, Instance]:
    inst = Instance(role="encode", index=0, instance_id="e0", host="127.0.0.1", rpc_port=7000, http_port=7001,
                    node="n0", draining=draining)
    return {inst.key: inst}


def test_a_role_not_listed_yet_is_waited_for():
    async def scenario() -> tuple[str, float]:
        peers = Peers()
        peers.update({})  # the first list: the encode worker's key not there yet
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, peers.update, _encode())
        start = time.monotonic()
        address = await peers.pick("encode")
        return address, time.monotonic() - start
    address, waited = asyncio.run(scenario())
    assert address == "127.0.0.1:7000" and 0.25 <= waited < 2


def test_a_role_that_left_or_drains_is_refused_at_once_and_one_never_listed_after_the_wait():
    async def scenario() -> list[tuple[str, float]]:
        peers = Peers()
        peers.update(_encode())
        peers.update({})  # the encode worker left
        outcomes = []
        for view, first_wait in ((None, 5.0), (_encode(draining=True), 5.0), ({}, 0.2)):
            if view is not None:
                peers.update(view)
            if first_wait == 0.2:
                peers = Peers()  # a worker whose discovery never listed the role
            start = time.monotonic()
            with pytest.raises(RemoteError, match="no live encode worker") as err:
                await peers.pick("encode", first_wait_s=first_wait)
            outcomes.append((err.value.code, time.monotonic() - start))
        return outcomes
    (gone, gone_s), (draining, draining_s), (never, never_s) = asyncio.run(scenario())
    assert gone == draining == never == 503
    assert gone_s < 0.1 and draining_s < 0.1 and 0.2 <= never_s < 1


def test_a_role_that_never_came_is_refused_at_once_once_the_first_list_is_old():
    """An encode worker that failed at start for good: every image must not wait the whole window again."""
    async def scenario() -> float:
        peers = Peers()
        peers.update({})
        peers.first_listed -= 60  # the worker has listed its peers for a minute
        start = time.monotonic()
        with pytest.raises(RemoteError, match="no live encode worker"):
            await peers.pick("encode")
        return time.monotonic() - start
    assert asyncio.run(scenario()) < 0.1
