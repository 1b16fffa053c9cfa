"""Worker RPC takes calls only from holders of the job's token."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.serve.rpc import PeerGone, RpcClient, RpcServer

pytestmark = pytest.mark.unit


def test_only_the_jobs_token_opens_a_connection():
    calls = []

    async def echo(body, payload):
        calls.append(body)
        yield {"ok": True}, b""

    async def main():
        server = RpcServer({"echo": echo}, token="s3cret-token")
        await server.start("127.0.0.1", 0)
        try:
            good = RpcClient("127.0.0.1", server.port, token="s3cret-token")
            assert (await good.call("echo", {"n": 1}))[0] == {"ok": True}
            for token in (None, "wrong-token"):
                bad = RpcClient("127.0.0.1", server.port, token=token)
                with pytest.raises((PeerGone, ConnectionError)):
                    await asyncio.wait_for(bad.call("echo", {"n": 2}), 10)
                await bad.close()
            await good.close()
            return server.refused
        finally:
            await server.close()
    refused = asyncio.run(main())
    assert refused == 2 and calls == [{"n": 1}]  # nothing ran for the callers without the token
