"""CPU time per token of a worker's output path, without a model or a GPU (runs anywhere).

    python benchmarks/token_path.py [--rows 64] [--steps 2000] [--rounds 3] [--link]

The real code from a decode step's tokens to the bytes on the worker's connection: an overlapped step's tokens
emitted as the scheduler emits them (`DecodeSteps._emit_inflight`: a row's first and last token through
`_emit_token`, the others bare, `Emitter.send_tokens`; the scheduler thread's part), then on the event loop the
Emitter's hand-over, `TorchEngine.stream`'s callback, the handler's deliver (`HandlerBase.generate`), the RPC stream sink
and its coalesced frame of replies, written to a socket that a thread drains. The requests enter as a worker's
do (`HandlerBase.generate` → `TorchEngine.stream`); no scheduler thread runs: this script takes their Seqs from
the engine's inbox and emits a token for every row, step after step, from a thread of its own, one step at a
time. In a worker the two threads share one GIL, so their CPU time per token adds up to what the process can
serve: at 20 µs a token one core serves 50k tokens/s. With `--link` (an engine in a process of its own, the
default on a GPU) the scheduler thread's part ends at the bytes on the link, and the worker's part is its event
loop reading them (`EngineProcess._delivered`: the messages decoded, each token's output made and delivered).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import socket
import threading
import time
from pathlib import Path

import torch

from hpc.runtime.engine.models.llama import LlamaConfig
from hpc.runtime.engine.torch.overlap import InflightStep
from hpc.runtime.engine.torch.picking import TokenPicker
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode
from hpc.runtime.serve import rpc
from hpc.runtime.serve.wire import GenerateRequest, SamplingParams
from hpc.runtime.worker.engine_link import Outputs
from hpc.runtime.worker.handlers import AggregatedHandler, HandlerDeps

VOCAB = 8192


def drain(sock: socket.socket, received: list) -> None:
    """The other end of the connection: read until it closes (what came, in `received`)."""
    while chunk := sock.recv(1 << 20):
        received.append(chunk)


def admitted(engine: TorchEngine, rows: int) -> list:
    """The submitted requests out of the engine's inbox, each in a slot as the scheduler would place it."""
    seqs = [engine._inbox.get_nowait() for _ in range(rows)]
    for slot, seq in enumerate(seqs):
        seq.slot, seq.length = slot, len(seq.request.token_ids)
    return seqs


def emit_step(engine: TorchEngine, seqs: list, step: int) -> None:
    """One decode step's tokens sent, as the scheduler sends an overlapped step's (DecodeSteps._emit_inflight)."""
    tokens = torch.full((len(seqs),), 100 + step % 4000, dtype=torch.long)
    engine.decode._emit_inflight(InflightStep(list(seqs), tokens, tokens))


def tiny_engine(mode: DisaggregationMode, rows: int, steps: int) -> TorchEngine:
    """An engine with no model, only what its output path reads (its config, the token picker's rules)."""
    engine = TorchEngine(Path("."), mode, {"max_seq_len": steps + 128, "max_batch_size": rows}, device="cpu")
    engine.core.cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, eos_token_id=2)
    engine.core.picker = TokenPicker(Path("."), engine.core.cfg.eos_token_id, engine.core.max_len, None)
    return engine


async def one_round(rows: int, steps: int) -> tuple[float, float, float]:
    """(scheduler-thread µs per token, event-loop µs per token, bytes on the connection per token)."""
    engine = tiny_engine(DisaggregationMode.AGGREGATED, rows, steps)
    engine._event_loop = asyncio.get_running_loop()
    handler = AggregatedHandler(HandlerDeps(engine=engine, mode=DisaggregationMode.AGGREGATED, peers=None,
                                            allowed_local_media_path=None, media_allowed_hosts=[],
                                            max_file_size_mb=1, image_size=None, has_encode_role=False))
    ours, theirs = socket.socketpair()
    received: list[bytes] = []
    drainer = threading.Thread(target=drain, args=(theirs, received), daemon=True)
    drainer.start()
    _, writer = await asyncio.open_connection(sock=ours)
    frames = rpc._Coalescer(writer)

    async def serve(sid: int) -> None:
        rpc._SINK.set(rpc.StreamSink(sid, frames))  # what the RPC server sets for each call's task
        request = GenerateRequest(request_id=f"r{sid}", token_ids=list(range(10, 74)),
                                  sampling=SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        async for _ in handler.generate(request, b""):
            pass

    tasks = [asyncio.create_task(serve(sid)) for sid in range(rows)]
    while engine._inbox.qsize() < rows:
        failed = next((t for t in tasks if t.done()), None)
        if failed is not None:
            failed.result()  # raises what ended it before it reached the engine
        await asyncio.sleep(0)
    seqs = admitted(engine, rows)
    delivered = asyncio.Event()
    loop = asyncio.get_running_loop()
    engine_cpu = []

    def scheduler() -> None:
        began = time.thread_time()
        for step in range(steps):
            emit_step(engine, seqs, step)
            # one step at a time, as a decode step's tokens are read only after the step ran
            engine_cpu.append(time.thread_time() - began)
            done = threading.Event()
            loop.call_soon_threadsafe(lambda: loop.call_soon(done.set))  # after the batch's delivery
            done.wait()
            began = time.thread_time()
        loop.call_soon_threadsafe(delivered.set)

    loop_began = time.thread_time()
    thread = threading.Thread(target=scheduler)
    thread.start()
    await delivered.wait()
    loop_cpu = time.thread_time() - loop_began
    thread.join()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    writer.close()
    await writer.wait_closed()
    drainer.join(timeout=10)
    theirs.close()
    tokens = rows * steps
    size = sum(map(len, received))
    if size < tokens:  # every token left as a reply of a few bytes at least
        raise SystemExit(f"only {size} bytes reached the socket for {tokens} tokens: the path did not run")
    return sum(engine_cpu) / tokens * 1e6, loop_cpu / tokens * 1e6, size / tokens


async def one_link_round(rows: int, steps: int) -> tuple[float, float, float]:
    """An engine in a process of its own (engine_core.py): its scheduler thread's `_emit_token` for each row into
    the LinkEmitter, the step's one Outputs message encoded and written to the worker's socket by that thread.
    Nothing of it runs on an event loop (the worker's side runs in the worker's process, with its own GIL)."""
    from hpc.runtime.worker.engine_core import Keyed, LinkEmitter
    from hpc.runtime.worker.engine_link import BlockingSender

    engine = tiny_engine(DisaggregationMode.DECODE, rows, steps)
    ours, theirs = socket.socketpair()
    received: list[bytes] = []
    drainer = threading.Thread(target=drain, args=(theirs, received), daemon=True)
    drainer.start()
    engine.core.emitter = LinkEmitter(BlockingSender(ours).send, lambda key: None)
    for key in range(rows):
        await engine.submit(GenerateRequest(request_id=f"r{key}", token_ids=list(range(10, 74)),
                                            sampling=SamplingParams(max_tokens=steps + 8, ignore_eos=True)),
                            Keyed(key))
    seqs = admitted(engine, rows)

    def scheduler() -> float:
        began = time.thread_time()
        for step in range(steps):
            emit_step(engine, seqs, step)
        return time.thread_time() - began

    cpu = await asyncio.to_thread(scheduler)
    ours.close()
    drainer.join(timeout=10)
    theirs.close()
    tokens = rows * steps
    delivered = worker_side(b"".join(received), rows)
    if delivered["tokens"] != tokens:
        raise SystemExit(f"the worker's side made {delivered['tokens']} outputs of {tokens} tokens: the path did "
                         f"not run")
    return cpu / tokens * 1e6, delivered["cpu"] / tokens * 1e6, delivered["bytes"] / tokens


def worker_side(data: bytes, rows: int) -> dict[str, float]:
    """The worker's event loop's part of the link: the engine process's bytes read and decoded, each output made
    and delivered to its request (EngineProcess._delivered; here to a counter)."""
    from hpc.runtime.worker.engine_link import FromEngine, Receiver
    from hpc.runtime.worker.engine_process import EngineProcess, _Stream

    made = [0]

    def deliver(out) -> None:
        made[0] += len(out.token_ids)

    process = EngineProcess.__new__(EngineProcess)
    process._requests = None
    process.timing = collections.defaultdict(float)  # its outputs messages' link times (stamped by the emitter)
    process._streams = {key: _Stream(deliver, None, 64) for key in range(rows)}
    receiver = Receiver(FromEngine, process._on_message, lambda: None)
    process._handlers = {Outputs: process._delivered}
    began = time.thread_time()
    for start in range(0, len(data), 1 << 16):  # as the loop reads them, a socket buffer at a time
        receiver.data_received(data[start:start + (1 << 16)])
    return {"cpu": time.thread_time() - began, "tokens": made[0], "bytes": len(data)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--link", action="store_true",
                        help="the engine in a process of its own (the default on a GPU): its scheduler thread's "
                             "part, up to the bytes on the link to its worker")
    args = parser.parse_args()
    one = one_link_round if args.link else one_round
    results = [asyncio.run(one(args.rows, args.steps)) for _ in range(args.rounds)]
    engine = [r[0] for r in results]
    loop = [r[1] for r in results]
    # a shared machine only ever slows a round down: the best round is the estimate
    print(f"output path, {args.rows} rows x {args.steps} steps, best of {args.rounds} rounds (CPU µs per token):")
    print(f"  scheduler thread (emit)          {min(engine):6.2f}   rounds " + " / ".join(f"{v:.2f}" for v in engine))
    if args.link:
        print(f"  worker's loop (read, deliver)    {min(loop):6.2f}   rounds " + " / ".join(f"{v:.2f}" for v in loop))
    else:
        print(f"  event loop (deliver, frames)     {min(loop):6.2f}   rounds " + " / ".join(f"{v:.2f}" for v in loop))
        print(f"  both (one GIL)                   {min(e + lp for e, lp in zip(engine, loop)):6.2f}")
    print(f"  bytes on the connection per token: {results[0][2]:.1f}")


if __name__ == "__main__":
    main()
