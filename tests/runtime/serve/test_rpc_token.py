"""Worker RPC takes calls only from holders of the job's token."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.serve.rpc import PeerGone, RpcClient, RpcServer
from hpc.runtime.serve.wire import StatsQuery, WorkerStats

pytestmark = pytest.mark.unit


def test_only_the_jobs_token_opens_a_connection():
    calls = []

    async def stats(query, payload):
        calls.append(query)
        yield WorkerStats(values={"ok": 1.0}), b""

    async def main():
        server = RpcServer({StatsQuery: stats}, token="s3cret-token")
        await server.start("127.0.0.1", 0)
        try:
            good = RpcClient("127.0.0.1", server.port, token="s3cret-token")
            assert (await good.call(StatsQuery()))[0] == WorkerStats(values={"ok": 1.0})
            for token in (None, "wrong-token"):
                bad = RpcClient("127.0.0.1", server.port, token=token)
                with pytest.raises((PeerGone, ConnectionError)):
                    await asyncio.wait_for(bad.call(StatsQuery()), 10)
                await bad.close()
            await good.close()
            return server.refused
        finally:
            await server.close()
    refused = asyncio.run(main())
    assert refused == 2 and calls == [StatsQuery()]  # nothing ran for the callers without the token
