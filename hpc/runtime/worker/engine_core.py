"""`python -m hpc.runtime.worker.engine_core`: a worker's torch engine in a process of its own.

The worker (engine_process.EngineProcess) starts it with the manifest, its role and index, the device and the
two ends of its link (engine_link.py). Here: the engine in `async with`, its side of the KV handoff (a decode
engine's fetches, the CUDA IPC copy queued where the engine's stream can wait for it; a prefill engine's KV shared
with its answers, lent and released), and the link. The scheduler thread reads its requests between steps and
sends each decode step's outputs itself (one message for all of its rows), its KV events and a decode's completed
KV copies; this process's event loop is left what must be awaited (a KV asked of a prefill worker, a prefill's KV
asked of it) and the stats. Its GIL is the engine's alone: the worker's RPC and output path run in the worker's
process (vLLM V1 splits its EngineCore from the API server for the same reason), and the loop seldom wakes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from typing import Any, AsyncGenerator, Callable

import msgspec

from hpc.manifest import Manifest
from hpc.runtime.services.logs import setup_component_logging
from hpc.runtime.engine.types import DisaggregationMode, GenerateOutput
from hpc.runtime.serve.rpc import RemoteError
from hpc.runtime.worker.engine_link import (
    AskKv, AskStats, BlockingSender, Drop, Failed, KvAnswer, KvEvents, Outputs, Poller, Ready, Refused, ReleaseHeld,
    ReleaseKvs, Stats, Stop, Submit, ToEngine, receive,
)

log = logging.getLogger("hpc.engine")
STATS_EVERY_S = 1.0  # the worker's load reports and /health read the last pushed figures
FLUSH_BUSY_S, FLUSH_IDLE_S = 0.01, 0.25  # KV releases the scheduler thread left waiting for their copies


class Keyed:
    """What the engine's submit() gets as a request's outputs: the key they go back to the worker under."""

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key


class LinkEmitter:
    """In place of the engine's Emitter (outputs.py), the worker at the other end of a socket, not on a loop: inside a
    decode step the rows' outputs gather and leave as one message when the step ends, written by the scheduler
    thread itself (no hop through this process's event loop); outside one each leaves at once.
    `prepare` (a prefill engine's): each output as it leaves — a prefill's answer gets its KV shared over CUDA IPC
    there (KvHandoff.attach_shared: the copies that made it are complete once the step's first tokens were read).
    On this process's event loop, as before, the answers waited for a loop that took the GIL from the scheduler
    thread at every turn."""

    def __init__(self, send: Callable[[Outputs], None], finished: Callable[[int], None],
                 prepare: Callable[[GenerateOutput], GenerateOutput] | None = None) -> None:
        self._send, self._finished, self._prepare = send, finished, prepare
        self._keys: list[int] = []
        self._outputs: list[GenerateOutput] = []
        self._token_keys: list[int] = []
        self._tokens: list[int] = []
        self._token_steps = 1
        self._batching = False

    def send(self, loop: Any, outputs: Keyed, out: GenerateOutput) -> None:
        if out.finished:
            self._finished(outputs.key)
        if self._batching:
            self._keys.append(outputs.key)
            self._outputs.append(out)
        else:
            self._leave(Outputs(keys=[outputs.key], outputs=[out], sent=time.perf_counter()))

    def _leave(self, message: Outputs) -> None:
        if self._prepare is not None:
            message = msgspec.structs.replace(message, outputs=[self._prepare(out) for out in message.outputs])
        self._send(message)

    def send_tokens(self, seqs: list, tokens: list[int], steps: int) -> None:
        """Only inside a step (DecodeSteps._emit_inflight): they leave with its message, a key a row."""
        if self._token_keys and steps != self._token_steps:  # one count a message: what came first leaves first
            self._flush()
        self._token_steps = steps
        self._token_keys += [seq.outputs.key for seq in seqs]
        self._tokens += tokens

    def __enter__(self) -> "LinkEmitter":
        self._batching = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._batching = False
        self._flush()

    def _flush(self) -> None:
        if self._keys or self._token_keys:
            message = Outputs(keys=self._keys, outputs=self._outputs, token_keys=self._token_keys, tokens=self._tokens,
                              token_steps=self._token_steps, sent=time.perf_counter())
            self._keys, self._outputs, self._token_keys, self._tokens = [], [], [], []
            self._leave(message)


class Core:
    """The requests this engine holds for its worker, by key; a prefill engine's KV answers."""

    def __init__(self, engine: Any, sender: BlockingSender, handoff: Any, gc_clock: Any) -> None:
        self.engine, self.sender, self.handoff, self.gc_clock = engine, sender, handoff, gc_clock
        self.seqs: dict[int, Any] = {}  # key -> Seq (None while its KV is fetched)
        self.poller: Poller | None = None  # the scheduler thread's own reads of the link (start_intake)
        self.frozen_objects = 0  # start-up's objects out of the collector's view (freeze_startup_objects)
        self.tasks: set[asyncio.Task] = set()
        # where a request's time goes in this process before the engine has it (seconds, summed over requests)
        # (of the link's time, a request's before the scheduler's look that found it began: its wait for a step's end)
        self.timing = {"link_seconds_total": 0.0, "link_unread_seconds_total": 0.0, "task_start_seconds_total": 0.0,
                       "requests_taken_by_scheduler_total": 0,  # submitted on its thread, never on the loop
                       "stats_seconds_total": 0.0, "stats_made_total": 0,  # the figures' own cost (stats)
                       "stats_cpu_seconds_total": 0.0, "stats_engine_seconds_total": 0.0}
        self.stopped = asyncio.Event()
        prefill = engine.mode is DisaggregationMode.PREFILL
        engine.core.emitter = LinkEmitter(sender.send, self._finished, handoff.attach_shared if prefill else None)
        self.handlers: dict[type, Callable[[Any], object]] = {  # what the worker asks, by message type
            Submit: self._submitted, Drop: self._dropped, AskKv: lambda message: self._start(self._answer_kv(message)),
            ReleaseHeld: lambda message: handoff.release(message.handle),
            AskStats: lambda message: sender.send(Stats(values=self.stats())),
            Stop: lambda message: self.stopped.set()}

    def _finished(self, key: int) -> None:  # on the scheduler thread
        self.seqs.pop(key, None)

    def stats(self) -> dict[str, float]:
        """The engine's figures and this process's. What making them costs is among them: it holds the GIL the
        scheduler thread waits for (py-spy put 2-4 % of each engine process's samples at c=64 on this line)."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        engine = self.engine.stats()
        self.timing["stats_engine_seconds_total"] += time.perf_counter() - t0
        values = {**engine, **self.handoff.counters, **self.timing, **self.gc_clock.stats("engine_"),
                  "engine_pid": os.getpid(), "engine_gc_frozen_objects": self.frozen_objects}
        if self.poller is not None:  # the scheduler's spins before it sleeps (runtime.idle_spin_us)
            values["engine_idle_spin_seconds_total"] = self.poller.spin_seconds
            values["engine_idle_spin_finds_total"] = self.poller.spin_finds
        self.timing["stats_seconds_total"] += time.perf_counter() - t0
        # this thread's CPU time of it: the wall time less what it waited for (the GIL the scheduler held)
        self.timing["stats_cpu_seconds_total"] += time.thread_time() - cpu0
        self.timing["stats_made_total"] += 1
        return values

    def _start(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def on_message(self, message: Any) -> None:
        self.handlers[type(message)](message)

    def _submitted(self, message: Submit) -> None:
        self.seqs[message.key] = None
        received = time.perf_counter()
        if message.sent:  # the worker's send to this loop's read, and this read to the request's task
            self.timing["link_seconds_total"] += received - message.sent
        self._start(self._submit(message, received))

    def _dropped(self, message: Drop) -> bool:
        seq = self.seqs.pop(message.key, None)
        if seq is not None:
            self.engine.cancel(seq)  # the scheduler frees its slot at the next step
        return True

    # ---- on the scheduler thread: the requests it reads itself -------------------------------------------------
    def start_intake(self, poller: Poller, loop: asyncio.AbstractEventLoop) -> None:
        """From now on the engine's scheduler thread reads the worker's messages between its steps (engine.intake):
        a request reaches it without waking this process's event loop, which took the GIL from the scheduler at
        every wake-up."""
        self.poller, self.loop = poller, loop
        self.looked = 0.0  # when the scheduler's latest look at the link began
        self.now: dict[type, Callable[[Any], bool]] = {Submit: self._submit_now, Drop: self._dropped}
        if self.handoff.nixl is None:  # a NIXL agent's withdrawal stays on the loop's thread
            self.now[ReleaseHeld] = lambda message: self.handoff.release(message.handle) or True
        self.engine.set_intake(self.intake, poller.wake)

    def intake(self, wait: float) -> None:
        """A Submit that needs nothing awaited (its KV shared with the prefill's answer, or none), a Drop and a
        ReleaseHeld are handled here; the rest (a KV to ask for, a prefill's KV asked of it, stats, Stop) on the
        event loop, as before."""
        poller = self.poller
        if poller is None:  # start_intake() made it before the engine calls this
            return
        closed = poller.closed
        self.looked = time.perf_counter()
        for message in poller.poll(wait):
            handle = self.now.get(type(message))
            if handle is None or not handle(message):
                self._to_loop(self.on_message, message)
        if poller.closed and not closed:
            self._to_loop(self.stopped.set)  # the worker gone: stop

    def _to_loop(self, callback: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: this process is stopping
            self.loop.call_soon_threadsafe(callback, *args)

    def _submit_now(self, message: Submit) -> bool:
        kv = None
        if self.engine.imports_kv(message.request):
            kv = self.handoff.fetch_now(message.request.disaggregated_params, self.loop)
            if kv is None:
                return False  # to be asked of the prefill worker: on the loop
        received = time.perf_counter()
        self.seqs[message.key] = None
        self.timing["requests_taken_by_scheduler_total"] += 1
        if message.sent:
            self.timing["link_seconds_total"] += received - message.sent
            self.timing["link_unread_seconds_total"] += max(0.0, self.looked - message.sent)
        try:
            seq = self.engine.submit_now(message.request, Keyed(message.key), kv)
        except Exception as exc:  # noqa: BLE001 - as _submit: the worker answers it
            if kv is not None:
                kv.drop()  # never copied: the prefill may free it
            self._refuse(message.key, exc)
            return True
        self._hold(message.key, seq)
        return True

    def _hold(self, key: int, seq: Any) -> None:
        """The submitted request's Seq under its key, unless a Drop came meanwhile (while its KV was fetched; or it
        finished already: then this changes nothing)."""
        if key in self.seqs:
            self.seqs[key] = seq
        else:
            self.engine.cancel(seq)

    def _refuse(self, key: int, exc: Exception) -> None:
        """A request that never reached the scheduler, with the code the RPC server gives it: a ValueError is the
        request's fault."""
        self.seqs.pop(key, None)
        code = 400 if isinstance(exc, ValueError) else exc.code if isinstance(exc, RemoteError) else 500
        self.sender.send(Refused(key=key, message=str(exc), code=code))

    async def _submit(self, message: Submit, received: float) -> None:
        self.timing["task_start_seconds_total"] += time.perf_counter() - received
        try:
            seq = await self.engine.submit(message.request, Keyed(message.key))
        except Exception as exc:  # noqa: BLE001 - whatever stops a request is the worker's to answer
            self._refuse(message.key, exc)
            return
        self._hold(message.key, seq)

    async def _answer_kv(self, message: AskKv) -> None:
        try:
            meta, data = await self.handoff.answer(message.call)
        except Exception as exc:  # noqa: BLE001 - the decode worker is told why, with the code it would get
            code = exc.code if isinstance(exc, RemoteError) else 500
            self.sender.send(KvAnswer(ask=message.ask, error=str(exc), code=code))
            return
        self.sender.send(KvAnswer(ask=message.ask, meta=meta, data=bytes(data)))

    async def report(self) -> None:
        """Stats every second; the engine's failure as soon as it is seen."""
        while not self.stopped.is_set():
            if self.engine.failure:
                self.sender.send(Failed(error=self.engine.failure))
                return
            self.sender.send(Stats(values=self.stats()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), STATS_EVERY_S)


async def flush_releases(handoff: Any, stopped: asyncio.Event) -> None:
    """The last settled KVs' releases, once their copies completed, when no admission on the scheduler thread
    comes to send them (it sends the others as it settles more): often while any wait, seldom otherwise."""
    while not stopped.is_set():
        await asyncio.sleep(FLUSH_BUSY_S if handoff.settling else FLUSH_IDLE_S)
        handoff.flush_settled()


@contextlib.asynccontextmanager
async def failures_told(sender: Any) -> AsyncGenerator[None, None]:
    """Building, loading, warming up or serving the engine failed: the worker is told why (Failed) before this
    process exits, so that its state and the launch say "OutOfMemoryError: CUDA out of memory..." and not only an
    exit code."""
    try:
        yield
    except Exception as exc:
        with contextlib.suppress(OSError):
            from hpc.runtime.services.node import failure_line

            sender.send(Failed(error=failure_line(exc)))
        raise


async def run(manifest: Manifest, role: str, index: int, device: str, requests_fd: int, outputs_fd: int) -> int:
    sender = BlockingSender(socket.socket(fileno=outputs_fd))
    async with failures_told(sender):
        return await serve_engine(manifest, role, index, device, requests_fd, sender)


async def serve_engine(manifest: Manifest, role: str, index: int, device: str, requests_fd: int,
                       sender: BlockingSender) -> int:
    from hpc.runtime.worker.engines import build_torch_engine
    from hpc.runtime.services.node import freeze_startup_objects, idle_spin_seconds, node_address, rpc_token, watch_gc
    from hpc.runtime.worker.handlers import Peers
    from hpc.runtime.worker.kv_handoff import KvHandoff, TransferDeadline, open_nixl

    plan = manifest.plan.worker(role, index)
    host = node_address(manifest)
    peers = Peers(token=rpc_token(manifest))  # a decode engine's: to the prefill workers whose KV it takes
    handoff = KvHandoff(setting=manifest.recipe.runtime.kv_transport, device=device, host=host, engine=None,
                        peers=peers, counters={},
                        deadline=TransferDeadline(manifest.recipe.runtime.kv_transfer_min_s,
                                                  manifest.recipe.runtime.kv_transfer_floor_gb_s))
    if DisaggregationMode(role) in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
        handoff.nixl = open_nixl(manifest.recipe.runtime.kv_transport, device.startswith("cuda"), plan.name)
    engine = build_torch_engine(manifest, role, self_address=f"{host}:{plan.ports['rpc']}", fetch_kv=handoff.fetch,
                          device=device, group=plan.group)
    handoff.engine = engine
    core = Core(engine, sender, handoff, watch_gc())
    # a prefill step's prefix-cache records, one message, sent by the scheduler thread itself (BlockingSender takes
    # any thread): through this process's loop each record's hop took the GIL from the scheduler at every turn
    engine.on_kv_events = lambda records: sender.send(KvEvents(records=records))
    # a decode engine's completed KV copies go to the worker, which releases them: not through this process's loop
    handoff.forward_releases = lambda addresses, handles: sender.send(ReleaseKvs(addresses=addresses,
                                                                                handles=handles))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, core.stopped.set)
    try:
        async with engine:
            requests_sock = socket.socket(fileno=requests_fd)
            if engine.traits.pulls_requests:
                core.start_intake(Poller(requests_sock, ToEngine,
                                         idle_spin_seconds(manifest.recipe.runtime.idle_spin_us, role)), loop)
                requests = None
            else:
                requests = await receive(requests_sock, ToEngine, core.on_message,
                                         core.stopped.set)  # the worker gone: stop
            # the model, torch's modules and the engine out of the collector's view: a full collection walked
            # them all while the scheduler thread waited for the GIL (the worker and frontends did this already)
            core.frozen_objects = freeze_startup_objects()
            sender.send(Ready(pid=os.getpid()))
            flushing = asyncio.create_task(flush_releases(handoff, core.stopped))
            await core.report()
            await core.stopped.wait()
            if requests is not None:
                requests.close()
            await flushing
            await handoff.settle()
    finally:
        handoff.close()
        await peers.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.runtime.worker.engine_core")
    parser.add_argument("manifest")
    parser.add_argument("--role", required=True, choices=["agg", "prefill", "decode"])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--requests-fd", type=int, required=True)
    parser.add_argument("--outputs-fd", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {args.role}-{args.index}.engine %(levelname)s %(message)s")
    # the worker stops this process (Stop, or its link closing); a Ctrl-C on a local launch reaches the whole
    # process group, and the worker's drain must still find its engine serving
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    manifest = Manifest.load(args.manifest)
    setup_component_logging(f"{args.role}-{args.index}.engine", manifest)
    return asyncio.run(run(manifest, args.role, args.index, args.device, args.requests_fd, args.outputs_fd))


if __name__ == "__main__":
    sys.exit(main())
