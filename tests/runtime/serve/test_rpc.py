"""The RPC server's write path."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.unit


def test_replies_written_in_one_loop_pass_leave_in_one_write():
    from hpc.runtime.serve.rpc import _Coalescer

    class Writer:  # the two calls the coalescer makes on an asyncio.StreamWriter
        def __init__(self):
            self.writes: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return False

    async def main():
        writer = Writer()
        out = _Coalescer(writer)
        for frame in (b"a", b"b", b"c"):  # a decode step's tokens for three streams
            out.write(frame)
        assert writer.writes == []  # nothing left yet: the rest of this pass may add more
        await asyncio.sleep(0)
        out.write(b"d")
        await asyncio.sleep(0)
        return writer.writes

    assert asyncio.run(main()) == [b"abc", b"d"]
