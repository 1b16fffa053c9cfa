"""The RPC server's write path."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.types import EngineBase, EngineTraits

pytestmark = pytest.mark.unit


class Writer:
    """The two calls the coalescer makes on an asyncio.StreamWriter."""

    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


def test_replies_written_in_one_loop_pass_leave_in_one_write():
    from hpc.runtime.serve.rpc import _Coalescer

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


def test_replies_without_payload_leave_as_one_frame_in_order_with_the_others():
    from hpc.runtime.serve.rpc import _Coalescer
    from hpc.runtime.serve.wire import HEADER, REPLIES_FRAME, GenerateOutput, Reply, decode_replies

    def frames(data: bytes) -> list:
        out = []
        while data:
            n_body, n_payload = HEADER.unpack(data[:HEADER.size])
            body = data[HEADER.size:HEADER.size + n_body]
            if n_payload == REPLIES_FRAME:
                out.append([(r.id, r.body.token_ids if r.body else None, r.end) for r in decode_replies(body)])
                n_payload = 0
            else:
                out.append(body + data[HEADER.size + n_body:HEADER.size + n_body + n_payload])
            data = data[HEADER.size + n_body + n_payload:]
        return out

    async def main():
        writer = Writer()
        out = _Coalescer(writer)
        for sid in (1, 2, 3):  # a decode step's tokens for three streams
            out.reply(Reply(sid, GenerateOutput(token_ids=[sid])))
        out.write(HEADER.pack(1, 2) + b"kKV")  # a frame with a payload: after them, on the connection
        out.reply(Reply(1, end=True))
        await asyncio.sleep(0)
        return writer.writes

    writes = asyncio.run(main())
    assert len(writes) == 1  # one write for the whole pass
    assert frames(writes[0]) == [[(1, [1], False), (2, [2], False), (3, [3], False)], b"kKV", [(1, None, True)]]


def test_a_handler_writes_frames_from_callbacks_through_its_sink_in_order_then_the_end():
    from hpc.runtime.serve.rpc import RpcClient, RpcServer, current_sink
    from hpc.runtime.serve.wire import GenerateOutput, GenerateRequest, StatsQuery, WorkerStats

    async def handler(call, payload):
        sink = current_sink()
        assert sink is not None
        yield GenerateOutput(token_ids=[1]), b""  # a yielded frame first, then three written from callbacks
        done = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        for token in (2, 3, 4):
            loop.call_soon(sink.send, GenerateOutput(token_ids=[token], finished=token == 4))
        loop.call_soon(done.set_result, None)
        await done

    async def stats(call, payload):  # a handler that never asks for its sink still streams as before
        yield WorkerStats(values={"sink_seen": float(current_sink() is not None)}), b""

    async def main():
        assert current_sink() is None  # outside a call
        server = RpcServer({GenerateRequest: handler, StatsQuery: stats})
        await server.start("127.0.0.1", 0)
        client = RpcClient("127.0.0.1", server.port)
        try:
            got = [out.token_ids[0] async for out, _ in client.stream(GenerateRequest(request_id="r", token_ids=[9]))]
            answer, _ = await client.call(StatsQuery())
        finally:
            await client.close()
            await server.close()
        return got, answer

    got, answer = asyncio.run(main())
    assert got == [1, 2, 3, 4] and answer.values == {"sink_seen": 1.0}


def test_closing_the_server_ends_open_connections_by_their_reads_not_by_cancelling_them():
    """A connection's task cancelled at interpreter exit made Python 3.11's stream callback log a traceback."""
    from hpc.runtime.serve.rpc import RpcServer

    async def main() -> None:
        server = RpcServer({})
        await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        await asyncio.sleep(0.05)
        serving = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert len(serving) == 1  # the connection's own task, waiting for a frame
        await server.close()
        assert serving[0].done() and not serving[0].cancelled()
        assert await asyncio.wait_for(reader.read(), 2) == b""  # the server closed its end
        writer.close()

    asyncio.run(main())


class _Engine(EngineBase):
    """A torch engine's stream() as the worker's handler uses it: each output to `deliver` on the loop; the last
    one finished, and the call returns a while later (its scheduler's bookkeeping), as the real one may."""

    traits = EngineTraits(direct_stream=True)

    def __init__(self) -> None:
        self.returned = asyncio.Event()

    async def stream(self, request, deliver) -> None:
        from hpc.runtime.serve.wire import GenerateOutput

        for token in (1, 2, 3):
            deliver(GenerateOutput(token_ids=[token], finished=token == 3, finish_reason="length" if token == 3
                                   else None))
            await asyncio.sleep(0)
        await asyncio.sleep(0.5)
        self.returned.set()


def test_a_workers_stream_ends_with_its_last_output_and_a_caller_stopping_there_cancels_nothing():
    """The handler ends the stream in the frame of its last output, before the engine's call returns; a caller
    that stops reading at that output sends no Cancel (it used to: a write, and a read on the worker, a request),
    one that stops earlier still does."""
    from hpc.runtime.engine.types import DisaggregationMode
    from hpc.runtime.serve.rpc import RpcClient, RpcServer
    from hpc.runtime.serve.wire import GenerateRequest
    from hpc.runtime.worker.handlers import AggregatedHandler, HandlerDeps, Peers

    async def main():
        engine = _Engine()
        deps = HandlerDeps(engine=engine, mode=DisaggregationMode.AGGREGATED, peers=Peers(),
                           allowed_local_media_path=None, media_allowed_hosts=[], max_file_size_mb=1.0,
                           image_size=None, has_encode_role=False)
        server = RpcServer(AggregatedHandler(deps).ops())
        await server.start("127.0.0.1", 0)
        client = RpcClient("127.0.0.1", server.port)
        request = GenerateRequest(request_id="r", token_ids=[9])
        try:
            whole = [out.token_ids[0] async for out, _ in client.stream(request)]
            ended_before_the_engine_returned = not engine.returned.is_set()
            stopped_at_the_last = client.stream(request)
            async for out, _ in stopped_at_the_last:
                if out.finished:
                    break
            await stopped_at_the_last.aclose()
            await asyncio.sleep(0.1)  # a Cancel, had one been sent, is read by now
            cancels_after_the_last = server.cancels
            stopped_early = client.stream(request)
            async for out, _ in stopped_early:
                break
            await stopped_early.aclose()
            await asyncio.sleep(0.1)
            return whole, ended_before_the_engine_returned, cancels_after_the_last, server.cancels
        finally:
            await client.close()
            await server.close()

    whole, ended_early, cancels_after_the_last, cancels = asyncio.run(main())
    assert whole == [1, 2, 3] and ended_early
    assert cancels_after_the_last == 0
    assert cancels == 1  # the caller that stopped after the first output


def test_a_stream_ends_once_and_an_error_after_its_end_is_only_logged(caplog):
    from hpc.runtime.serve.rpc import StreamSink, _Coalescer
    from hpc.runtime.serve.wire import HEADER, decode_replies

    async def main() -> list[bytes]:
        writer = Writer()
        sink = StreamSink(7, _Coalescer(writer))
        sink.end()  # with the stream's last output, by its handler
        sink.end()  # the RPC server's own, once the handler returned
        sink.end("late failure", 500)
        await asyncio.sleep(0)
        return writer.writes

    writes = asyncio.run(main())
    assert len(writes) == 1
    assert [(r.id, r.end, r.error) for r in decode_replies(writes[0][HEADER.size:])] == [(7, True, None)]
    assert "late failure" in caplog.text


def test_a_stream_is_over_at_its_last_output_even_when_its_end_frame_comes_late():
    """A finished output is a request's last: a caller reading on gets the stream's end at once, not when the
    worker's end frame arrives (a worker other than ours might send it a while later)."""
    from hpc.runtime.serve.rpc import RpcClient, RpcServer, current_sink
    from hpc.runtime.serve.wire import GenerateOutput, GenerateRequest

    async def handler(call, payload):
        current_sink().send(GenerateOutput(token_ids=[1], finished=True, finish_reason="length"))
        await asyncio.sleep(1.0)  # the end frame, from the server once this returns, a second later
        return
        yield

    async def main() -> tuple[list[int], float, int]:
        server = RpcServer({GenerateRequest: handler})
        await server.start("127.0.0.1", 0)
        client = RpcClient("127.0.0.1", server.port)
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            got = [out.token_ids[0] async for out, _ in client.stream(GenerateRequest(request_id="r", token_ids=[9]))]
            return got, loop.time() - t0, server.cancels
        finally:
            await client.close()
            await server.close()

    got, seconds, cancels = asyncio.run(main())
    assert got == [1] and seconds < 0.5 and cancels == 0


def test_only_an_end_an_error_or_a_lost_connection_waiting_unread_spares_the_cancel():
    from hpc.runtime.serve.rpc import _DEADLINE, _ended
    from hpc.runtime.serve.wire import GenerateOutput, Reply

    def queue_of(*items) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        return queue

    token = (Reply(1, GenerateOutput(token_ids=[1])), b"")
    assert _ended(queue_of(token, (Reply(1, end=True), b"")))
    assert _ended(queue_of((Reply(1, end=True, error="boom", code=500), b"")))
    assert _ended(queue_of(token, None))  # the connection lost
    assert not _ended(queue_of(token))
    assert not _ended(queue_of(_DEADLINE))  # past its deadline the worker still runs it: cancel
