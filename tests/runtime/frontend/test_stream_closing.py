"""A frontend that stops reading a worker's stream closes the chain of generators between them at once: no
generator is left for the event loop's finalizer (a task each, ~20 µs a request), and a stream stopped before
its end tells the worker to cancel before the caller goes on."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest

from hpc.runtime.frontend.router import Router
from hpc.runtime.serve.rpc import RpcClient, RpcServer, current_sink
from hpc.runtime.serve.wire import GenerateOutput, GenerateRequest, SamplingParams
from hpc.runtime.services.discovery import Instance
from hpc.spec.recipe import RouterPolicy

pytestmark = pytest.mark.unit


async def _tokens(request: GenerateRequest, payload: bytes):
    """A worker's stream: `max_tokens` outputs written through the sink, the last finished and the end with it
    (as HandlerBase.generate does), a little apart."""
    sink = current_sink()
    count = request.sampling.max_tokens
    for token in range(count):
        sink.send(GenerateOutput(token_ids=[token], finished=token == count - 1,
                                 finish_reason="length" if token == count - 1 else None))
        if token == count - 1:
            sink.end()
        await asyncio.sleep(0.001)
    return
    yield  # an async generator that writes through its sink


async def _run(stop_after: int | None, max_tokens: int) -> tuple[list[int], int, int]:
    """(tokens read, generators handed to the loop's finalizer, Cancels the worker read) for a caller that reads
    router.generate as the frontend's _outputs does, stopping after `stop_after` outputs or at the finished one."""
    loop = asyncio.get_running_loop()
    finalized = []

    def finalizer(agen) -> None:
        finalized.append(agen)
        loop._asyncgen_finalizer_hook(agen)

    firstiter, _ = sys.get_asyncgen_hooks()
    sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalizer)
    server = RpcServer({GenerateRequest: _tokens})
    await server.start("127.0.0.1", 0)
    instance = Instance(role="agg", index=0, instance_id="agg-0", host="127.0.0.1", rpc_port=server.port,
                        http_port=0, node="n0")
    router = Router(RouterPolicy.ROUND_ROBIN)
    router.update({instance.key: instance}, now=0.0)
    router.clients[instance.key] = RpcClient("127.0.0.1", server.port)
    request = GenerateRequest(request_id="r", token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens))
    got: list[int] = []
    try:
        async with contextlib.aclosing(router.generate("agg", request)) as outs:
            async for out in outs:
                got.append(out.token_ids[0])
                if out.finished or (stop_after is not None and len(got) == stop_after):
                    break
        await asyncio.sleep(0.05)  # the worker reads a Cancel, had one been sent
        return got, len(finalized), server.cancels
    finally:
        await router.close()
        await server.close()


def test_a_caller_stopping_at_the_last_output_leaves_no_generator_and_cancels_nothing():
    got, finalized, cancels = asyncio.run(_run(stop_after=None, max_tokens=3))
    assert got == [0, 1, 2]
    assert finalized == 0 and cancels == 0


def test_a_caller_stopping_early_closes_the_chain_and_cancels_the_workers_stream():
    got, finalized, cancels = asyncio.run(_run(stop_after=2, max_tokens=50))
    assert got == [0, 1]
    assert finalized == 0 and cancels == 1
