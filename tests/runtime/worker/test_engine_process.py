"""A worker's engine in a process of its own: the link's messages, and a disaggregated stack whose prefill and decode
workers run their engines apart (runtime.engine_process=own) serving, handing KV over, cancelling, refusing and
failing as ones that do not."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest

from hpc.runtime.engine.types import EngineBase, EngineTraits
import torch

from hpc.checks.probe import get_text, metric_values, post_json
from hpc.runtime.engine.torch.kv_records import KvRecord
from hpc.runtime.engine.types import DisaggregatedParams, DisaggregationMode, GenerateOutput, GenerateRequest
from hpc.runtime.worker.engine_core import Keyed, LinkEmitter
from hpc.runtime.worker.engine_link import (FromEngine, KvEvents, Outputs, Receiver, Refused, Submit, ToEngine,
                                           encode)
from hpc.runtime.serve.rpc import RemoteError
from hpc.runtime.worker.engine_process import EngineProcess, engine_in_own_process
from hpc.spec.recipe import Backend
from hpc.waiting import wait_until
from tests.runtime.conftest import stack_fixture

AGG, DECODE, PREFILL = DisaggregationMode.AGGREGATED, DisaggregationMode.DECODE, DisaggregationMode.PREFILL
ENCODE = DisaggregationMode.ENCODE


@pytest.mark.unit
@pytest.mark.parametrize("setting,backend,modality,mode,ranks,gpu,want", [
    ("auto", Backend.TORCH, "text", DECODE, 1, True, True),  # the GPU case the split is for
    ("auto", Backend.TORCH, "text", AGG, 1, True, True),
    ("auto", Backend.TORCH, "text", DECODE, 1, False, False),  # CPU: one process, as before
    ("own", Backend.TORCH, "text", DECODE, 1, False, True),
    ("own", Backend.TORCH, "text", PREFILL, 1, False, True),  # its engine process lends the KV itself
    ("auto", Backend.TORCH, "text", PREFILL, 1, True, True),
    ("own", Backend.TORCH, "text", ENCODE, 1, True, False),
    ("own", Backend.TORCH, "text", DECODE, 2, True, False),  # rank 0's engine is an MPI rank
    ("own", Backend.TRTLLM, "text", DECODE, 1, True, False),
    ("own", Backend.TORCH, "multimodal", AGG, 1, True, False),
    ("worker", Backend.TORCH, "text", DECODE, 1, True, False),
])
def test_which_workers_run_their_engine_apart(setting, backend, modality, mode, ranks, gpu, want):
    assert engine_in_own_process(setting, backend, modality, mode, ranks, gpu) is want


@pytest.mark.unit
def test_a_decode_steps_outputs_leave_as_one_message_and_others_at_once():
    sent, finished = [], []
    emitter = LinkEmitter(sent.append, finished.append)
    with emitter:
        for key in (3, 5, 7):
            emitter.send(None, Keyed(key), GenerateOutput(token_ids=[key], finished=key == 5))
        assert sent == []  # nothing leaves before the step ends
    emitter.send(None, Keyed(9), GenerateOutput(token_ids=[1]))
    assert [m.keys for m in sent] == [[3, 5, 7], [9]]
    assert [o.token_ids for o in sent[0].outputs] == [[3], [5], [7]] and finished == [5]


@pytest.mark.unit
def test_a_steps_bare_tokens_cross_as_ints_and_become_the_outputs_the_engine_would_send():
    """A step's bare tokens (Emitter.send_tokens) leave as two lists of ints beside its whole outputs; the worker
    makes each one's output from what its request's earlier output carried (cached tokens) and its prompt."""
    from hpc.runtime.engine.torch.sequence import Seq
    from hpc.runtime.worker.engine_process import _Stream

    sent = []
    emitter = LinkEmitter(sent.append, lambda key: None)
    seqs = {key: Seq(request=GenerateRequest(request_id=str(key), token_ids=[1] * (key + 3)), emit=lambda out: None,
                     outputs=Keyed(key)) for key in (3, 5, 7)}
    with emitter:
        emitter.send(None, Keyed(7), GenerateOutput(token_ids=[70], prompt_tokens=10, finished=True))
        emitter.send_tokens([seqs[3], seqs[5]], [31, 51], 1)
        assert sent == []  # bare tokens leave with their step's message, never alone
    assert len(sent) == 1 and (sent[0].keys, sent[0].token_keys, sent[0].tokens) == ([7], [3, 5], [31, 51])
    assert emitter._token_keys == [] and emitter._tokens == []  # the next step starts empty
    with emitter:  # a replay of three steps: a key a row, its tokens in turn, the count once
        emitter.send_tokens([seqs[3], seqs[5]], [32, 33, 34, 52, 53, 54], 3)
    assert (sent[1].token_keys, sent[1].tokens, sent[1].token_steps) == ([3, 5], [32, 33, 34, 52, 53, 54], 3)
    with emitter:  # another count in the same step: what came first leaves first, each with its own count
        emitter.send_tokens([seqs[3]], [35, 36], 2)
        emitter.send_tokens([seqs[5]], [55], 1)
    assert [(m.token_keys, m.tokens, m.token_steps) for m in sent[2:]] == [([3], [35, 36], 2), ([5], [55], 1)]

    async def worker_side() -> tuple[dict, dict]:
        process = EngineProcess.__new__(EngineProcess)
        process._requests = None  # nothing to send a Drop on
        got: dict[int, list] = {3: [], 5: []}
        loop = asyncio.get_running_loop()

        def refuse(out):
            raise ValueError("the caller's own error")

        process._streams = {3: _Stream(got[3].append, loop.create_future(), 6),
                            5: _Stream(got[5].append, loop.create_future(), 8),
                            9: _Stream(refuse, loop.create_future(), 2)}
        first = GenerateOutput(token_ids=[30], prompt_tokens=6, cached_tokens=4)
        process._delivered(Outputs(keys=[3, 5], outputs=[first, GenerateOutput(token_ids=[50], prompt_tokens=8)]))
        process._delivered(Outputs(keys=[], outputs=[], token_keys=[3, 5, 9, 11], tokens=[31, 51, 91, 111]))
        # a replay of several steps: a key a row, its tokens in turn, one output for them
        process._delivered(Outputs(keys=[], outputs=[], token_keys=[3, 5], tokens=[32, 33, 34, 52, 53, 54],
                                   token_steps=3))
        failed = process._streams.get(9)
        return got, {"left": sorted(process._streams), "failed": failed}

    got, rest = asyncio.run(worker_side())
    assert got[3] == [GenerateOutput(token_ids=[30], prompt_tokens=6, cached_tokens=4),
                      GenerateOutput(token_ids=[31], prompt_tokens=6, cached_tokens=4),
                      GenerateOutput(token_ids=[32, 33, 34], prompt_tokens=6, cached_tokens=4)]
    assert got[5][1:] == [GenerateOutput(token_ids=[51], prompt_tokens=8, cached_tokens=0),
                          GenerateOutput(token_ids=[52, 53, 54], prompt_tokens=8, cached_tokens=0)]
    # a deliver that raised drops its request (the engine is told), key 11 unknown: skipped
    assert rest == {"left": [3, 5], "failed": None}


@pytest.mark.unit
def test_a_decode_engines_completed_copies_are_released_by_its_worker():
    """ReleaseKvs from the engine process (its scheduler thread's, through the link) becomes one ReleaseKv for
    each prefill worker's KV, sent by the worker (EngineHandoff), and waited for as the worker stops."""
    from hpc.runtime.serve.wire import ReleaseKv
    from hpc.runtime.worker.engine_link import ReleaseKvs
    from hpc.runtime.worker.engine_process import EngineHandoff

    calls = []

    class Prefill:
        def __init__(self, address: str) -> None:
            self.address = address

        async def call(self, body):
            await asyncio.sleep(0.01)
            calls.append((self.address, body))

    class Peers:
        def client(self, address: str) -> Prefill:
            return Prefill(address)

    engine = EngineProcess("m.json", "decode", 0, "cuda:1", 5.0)
    handoff = EngineHandoff(engine, Peers())
    message = ReleaseKvs(addresses=["10.0.0.1:7000", "10.0.0.2:7000"], handles=["h-1", "h-$(x)`y`"])
    got = []
    Receiver(FromEngine, got.append, lambda: None).data_received(encode(message))
    assert got == [message]

    async def main():
        engine._on_message(got[0])  # as the link delivers it
        assert calls == []  # in the background
        await handoff.settle()

    asyncio.run(main())
    assert calls == [("10.0.0.1:7000", ReleaseKv(handle="h-1")), ("10.0.0.2:7000", ReleaseKv(handle="h-$(x)`y`"))]


class _IntakeEngine(EngineBase):
    """What Core's intake uses of a TorchEngine: submit_now records the thread it ran on; a bad prompt refused."""

    traits = EngineTraits(pulls_requests=True)

    def __init__(self) -> None:
        self.submitted: list[tuple[int, object, int]] = []
        self.intake = None

    def set_intake(self, intake, wake) -> None:
        self.intake = intake

    @staticmethod
    def imports_kv(request) -> bool:
        return request.disaggregated_params is not None

    def submit_now(self, request, outputs, imported_kv=None):
        import threading

        if not request.token_ids:
            raise ValueError("empty prompt")
        self.submitted.append((outputs.key, imported_kv, threading.get_ident()))
        return type("Seq", (), {"cancelled": False})()

    @staticmethod
    def cancel(seq) -> None:  # TorchEngine.cancel: its flag (and the scheduler's count, which this has not)
        seq.cancelled = True


class _IntakeHandoff:
    """A KV shared with the answer (params.kv set) is in hand at once; any other must be asked for."""

    nixl = None

    def __init__(self) -> None:
        self.released: list[str] = []
        self.dropped = 0

    def fetch_now(self, params, loop):
        if params.kv is None:
            return None
        handoff = self

        class Pending:
            def drop(self):
                handoff.dropped += 1
        return Pending()

    def release(self, handle: str) -> None:
        self.released.append(handle)


@pytest.mark.unit
def test_the_scheduler_thread_takes_its_own_requests_and_leaves_the_rest_to_the_loop():
    """An engine process's intake: on the scheduler's thread, a request whose KV came with the prefill's answer
    (or that needs none), a Drop and a ReleaseHeld; on the event loop, a request whose KV must be asked for and
    stats; a refusal answered at once (its KV let go); the worker gone: the process stops."""
    import socket
    import threading

    from hpc.runtime.serve.wire import CudaIpc, KvMeta
    from hpc.runtime.worker.engine_core import Core
    from hpc.runtime.worker.engine_link import AskStats, Drop, Poller, ReleaseHeld, Stats

    shared = KvMeta(shape=[1], dtype="torch.bfloat16",
                    ipc=CudaIpc(device=0, handle=b"\1" * 64, allocation_bytes=64, offset_bytes=0, size_bytes=64))

    def params(kv):
        return DisaggregatedParams(request_handle="h", prefill_address="10.0.0.1:7000", first_token_id=5,
                                   prompt_length=3, kv=kv)

    worker, ours = socket.socketpair()
    sent = []

    class Sender:
        def send(self, message):
            sent.append(message)

    async def main():
        loop = asyncio.get_running_loop()
        engine, handoff = _IntakeEngine(), _IntakeHandoff()
        core = Core.__new__(Core)  # its state without the engine process's start-up
        core.engine, core.sender, core.handoff, core.seqs = engine, Sender(), handoff, {}
        core.timing = {"link_seconds_total": 0.0, "link_unread_seconds_total": 0.0, "task_start_seconds_total": 0.0,
                       "requests_taken_by_scheduler_total": 0}
        core.stopped, core.tasks = asyncio.Event(), set()
        on_loop = []
        core.handlers = {Submit: on_loop.append, AskStats: lambda m: core.sender.send(Stats(values={"x": 1.0}))}
        core.start_intake(Poller(ours, ToEngine), loop)
        assert engine.intake == core.intake
        request = GenerateRequest(request_id="r", token_ids=[1, 2, 3])
        for message in (Submit(key=1, request=msgspec.structs.replace(request, disaggregated_params=params(shared))),
                        Submit(key=2, request=request),  # an aggregated / prefill request: no KV
                        Submit(key=3, request=msgspec.structs.replace(request, disaggregated_params=params(None))),
                        Submit(key=4, request=msgspec.structs.replace(request, token_ids=[],
                                                                      disaggregated_params=params(shared))),
                        Drop(key=2), ReleaseHeld(handle="held-1"), AskStats()):
            worker.sendall(encode(message))
        scheduler = threading.Thread(target=engine.intake, args=(1.0,))
        scheduler.start()
        scheduler.join()
        await asyncio.sleep(0.01)  # what went to the loop
        worker.close()
        await asyncio.to_thread(engine.intake, 1.0)
        await asyncio.wait_for(core.stopped.wait(), 5)
        return engine, handoff, on_loop, scheduler.ident, core

    engine, handoff, on_loop, scheduler, core = asyncio.run(main())
    seqs = core.seqs
    assert [(key, kv is not None, thread == scheduler) for key, kv, thread in engine.submitted] == [
        (1, True, True), (2, False, True)]
    assert core.timing["requests_taken_by_scheduler_total"] == 3  # 1, 2 and the refused 4 (on /metrics)
    assert [m.key for m in on_loop] == [3]  # its KV to be asked for
    assert [(type(m).__name__, getattr(m, "key", None)) for m in sent] == [("Refused", 4), ("Stats", None)]
    assert sent[0].code == 400 and handoff.dropped == 1  # the refused request's KV let go
    assert handoff.released == ["held-1"] and list(seqs) == [1]  # 2 dropped, 4 refused


@pytest.mark.unit
def test_an_idle_intake_wait_ends_at_a_message_or_a_wake_up():
    """The scheduler waits on its requests' socket when idle: a request put in its inbox by another thread (one
    whose KV the loop fetched) wakes it at once, not at the wait's end; so does a message."""
    import socket
    import threading

    from hpc.runtime.worker.engine_link import Poller

    worker, ours = socket.socketpair()
    poller = Poller(ours, ToEngine)
    threading.Timer(0.05, poller.wake).start()
    began = time.monotonic()
    assert poller.poll(5.0) == [] and time.monotonic() - began < 2
    threading.Timer(0.05, lambda: worker.sendall(encode(Submit(key=7, request=GenerateRequest(
        request_id="r", token_ids=[1]))))).start()
    began = time.monotonic()
    assert [m.key for m in poller.poll(5.0)] == [7] and time.monotonic() - began < 2
    assert poller.poll(0.0) == [] and not poller.closed
    worker.close()
    assert poller.poll(5.0) == [] and poller.closed


@pytest.mark.unit
def test_the_scheduler_reads_messages_whole_split_anywhere_or_larger_than_its_read():
    """Poller: a message cut inside its length and its body arrives whole once its last byte does; one larger than
    a read (1 MB) too, and the bytes after it start the next."""
    import socket
    import threading

    from hpc.runtime.worker.engine_link import Poller

    worker, ours = socket.socketpair()
    poller = Poller(ours, ToEngine)
    small = encode(Submit(key=1, request=GenerateRequest(request_id="a", token_ids=[1, 2])))
    worker.sendall(small[:2])  # inside the length
    assert poller.poll(0.0) == []
    worker.sendall(small[2:7])  # inside the body
    assert poller.poll(0.0) == []
    worker.sendall(small[7:])
    assert [m.key for m in poller.poll(0.0)] == [1]
    big = Submit(key=2, request=GenerateRequest(request_id="b", token_ids=list(range(100_000, 500_000))))
    sender = threading.Thread(target=worker.sendall, args=(encode(big) + small,))  # > 1 MB: several reads
    sender.start()
    got = []
    for _ in range(200):  # a few reads; a lost byte would leave it waiting: bounded
        if len(got) >= 2:
            break
        got += poller.poll(0.05)
    sender.join(5)
    assert [m.key for m in got] == [2, 1] and got[0] == big and not poller.closed


@pytest.mark.unit
def test_messages_are_read_whole_however_the_bytes_arrive():
    hostile = "$(rm -rf /) `x` 'q' \"d\"\nnew line"
    messages = [Submit(key=i, request=GenerateRequest(request_id=hostile * i, token_ids=list(range(i + 1))))
                for i in range(5)]
    stream = b"".join(encode(m) for m in messages)
    for cut in (1, 2, 3, 5, 7, len(stream)):  # pieces that split length headers and bodies
        got, closed = [], []
        receiver = Receiver(ToEngine, got.append, lambda: closed.append(True))
        for start in range(0, len(stream), cut):
            receiver.data_received(stream[start:start + cut])
        assert got == messages and receiver.buffer == b""
        receiver.connection_lost(None)
        assert closed == [True]
    records = [KvRecord(1, 2, [7, 8]), KvRecord(2, 2, [5, 6], parent=4, tokens=[1, 2, 3, 4])]
    mixed = [Outputs(keys=[1], outputs=[GenerateOutput(token_ids=[2])], token_keys=[4, 6], tokens=[9, 10, 11, 12],
                     token_steps=2),
             Refused(key=1, message=hostile, code=400),
             KvEvents(records=records)]
    got = []
    Receiver(FromEngine, got.append, lambda: None).data_received(b"".join(encode(m) for m in mixed))
    assert got == mixed
    # the worker's side: a step's records, one message, go on to its publisher one by one, in order
    published = []
    worker_side = EngineProcess.__new__(EngineProcess)
    worker_side.on_kv_event = published.append
    worker_side._kv_events(got[-1])
    assert published == [  # in TensorRT-LLM's form (tensorrt_llm/_utils.py KVCacheEventSerializer)
        {"event_id": 1, "data": {"type": "removed", "block_hashes": [7, 8]}, "window_size": 2},
        {"event_id": 2, "data": {"type": "stored", "parent_hash": 4, "blocks": [
            {"type": "stored_block", "block_hash": h, "lora_id": None, "cache_level": 0, "priority": 35,
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in pair]}
            for h, pair in ((5, (1, 2)), (6, (3, 4)))]}, "window_size": 2}]


# idle_spin_us set: its auto leaves it off on a machine of fewer than 8 CPUs, as CI's
# four decode steps a replay at most (a GPU's tiny model would take eight): the counts below follow a row's replays
apart = stack_fixture("tiny-disagg", "--set", "runtime.engine_process=own", "--set", "runtime.idle_spin_us=3000",
                      "--set", "torch_engine.decode_steps_per_graph=4")
SPINS = ("hpc_worker_worker_idle_spin_seconds_total", "hpc_worker_engine_idle_spin_seconds_total")
PROMPT = "The capital of France is"


def _state(stack, worker: str) -> dict:
    return json.loads((stack.run.state / f"{worker}.json").read_text())


def _metric(stack, worker: str, name: str) -> float:
    return metric_values(get_text(_state(stack, worker)["http"] + "/metrics"), name)


def _frontend_spin(stack) -> float:
    return metric_values(get_text(stack.url + "/metrics"), "hpc_frontend_idle_spin_seconds_total")


def _complete(stack, **extra):
    body = {"model": stack.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **extra}
    return post_json(stack.url + "/v1/completions", body)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.integration
def test_the_decode_worker_serves_from_an_engine_process_of_its_own(apart, tiny):
    decode = _state(apart, "decode-0")
    engine_pid = int(_metric(apart, "decode-0", "hpc_worker_engine_pid"))
    assert engine_pid == decode["engine_pid"] and engine_pid != decode["pid"]
    assert "hpc.runtime.worker.engine_core" in _cmdline(engine_pid) and " --role decode " in _cmdline(engine_pid)
    # start-up's objects (the model, torch's modules) out of the engine process's collector's view, as the
    # worker's and the frontend's; its collections are counted: start-up's full ones (the one before the freeze;
    # on a GPU, also those before each graph capture), none while it serves
    assert _metric(apart, "decode-0", "hpc_worker_engine_gc_frozen_objects") > 10_000
    full_collections = _metric(apart, "decode-0", "hpc_worker_engine_gc_full_collections_total")
    assert full_collections >= 1
    prefill = _state(apart, "prefill-0")  # the prefill worker's engine too: it holds the KV it hands over
    assert prefill["engine_pid"] not in (prefill["pid"], engine_pid)
    assert "hpc.runtime.worker.engine_core" in _cmdline(prefill["engine_pid"])
    steps = _metric(apart, "decode-0", "hpc_worker_decode_steps")
    generated = _metric(apart, "decode-0", "hpc_worker_generated_tokens")
    served = _metric(apart, "decode-0", "hpc_worker_requests_streamed_direct")
    bare = _metric(apart, "decode-0", "hpc_worker_decode_tokens_bare_total")
    messages = _metric(apart, "decode-0", "hpc_worker_outputs_messages_total")
    spun = [_metric(apart, "decode-0", name) for name in SPINS]
    frontend_spun = _frontend_spin(apart)
    assert _frontend_spin(apart) == frontend_spun  # a GET of /metrics is a probe, not a request: no spin
    status, body = _complete(apart)
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    assert _metric(apart, "decode-0", "hpc_worker_engine_gc_full_collections_total") == full_collections
    # the engine process decoded it (its counters reach the worker's /metrics) and took the KV itself
    # (11 decode tokens: on a GPU a graph replay may run four decode steps, counted as one)
    assert _metric(apart, "decode-0", "hpc_worker_generated_tokens") == generated + 11
    replays = _metric(apart, "decode-0", "hpc_worker_decode_steps") - steps
    assert 3 <= replays <= 11
    assert _metric(apart, "decode-0", "hpc_worker_requests_streamed_direct") == served + 1
    # its middle tokens crossed the link bare (the decode engine's first and the last whole): 12 - 1 prefilled - 2
    # a step at a time; with four steps a replay (a GPU), a replay's tokens of a row all bare or all whole, and
    # the replay that holds the last token whole: at least one replay's four
    crossed_bare = _metric(apart, "decode-0", "hpc_worker_decode_tokens_bare_total") - bare
    assert (4 if torch.cuda.is_available() else 9) <= crossed_bare <= 9
    # the time before the engine had it, measured in its process: the link from the worker; on a GPU its KV came
    # with the prefill's answer, so the scheduler's thread took it (no event loop task); on CPU the loop fetched
    # the KV's bytes (a task, whose wait to start is timed)
    link = _metric(apart, "decode-0", "hpc_worker_link_seconds_total")
    assert 0 < link < 5
    # of it, the wait for the scheduler's next look (on CPU the loop took the request: none)
    assert 0 <= _metric(apart, "decode-0", "hpc_worker_link_unread_seconds_total") <= link
    # and back: each outputs message timed from the engine process's send to the worker's read, a step's one
    # message for all its rows (the first and last outputs of a step leave with its message)
    assert _metric(apart, "decode-0", "hpc_worker_outputs_messages_total") >= messages + replays
    assert 0 < _metric(apart, "decode-0", "hpc_worker_outputs_link_seconds_total") < 5
    # what the engine process's figures cost to make, timed as it makes them (a /metrics read asks for them)
    made = _metric(apart, "decode-0", "hpc_worker_stats_made_total")
    assert made >= 1 and 0 < _metric(apart, "decode-0", "hpc_worker_stats_seconds_total") < made * 0.1
    assert _metric(apart, "decode-0", "hpc_worker_stats_made_total") > made
    on_scheduler = _metric(apart, "decode-0", "hpc_worker_requests_taken_by_scheduler_total")
    task_start = _metric(apart, "decode-0", "hpc_worker_task_start_seconds_total")
    if torch.cuda.is_available():
        assert on_scheduler >= 1 and task_start == 0, (on_scheduler, task_start)
    else:
        assert on_scheduler == 0 and 0 < task_start < 5, (on_scheduler, task_start)
    # GPUs of one node: the KV came with the prefill's answer (CUDA IPC); CPU: as bytes
    moved = "hpc_worker_kv_taken_from_answer" if torch.cuda.is_available() else "hpc_worker_kv_fetched_bytes"
    assert _metric(apart, "decode-0", moved) >= 1  # (bytes: asked of the prefill worker, answered by its engine's)
    # taken or released, none left behind (a GPU's release follows its copy, asynchronously: waited for)
    wait_until(lambda: _metric(apart, "prefill-0", "hpc_worker_handoffs_waiting") == 0, 5,
               "the prefill worker's KV released")
    # after the request the worker's loop and the engine's scheduler each polled without sleeping (3 ms after its
    # start and its end; the scheduler after its last step), then slept again
    for name, before in zip(SPINS, spun):
        wait_until(lambda: _metric(apart, "decode-0", name) >= before + 0.002, 5, name)
        assert _metric(apart, "decode-0", name) < before + 1.0
    # and the frontend's loop, from the request's start to 3 ms after its end
    assert frontend_spun + 0.003 <= _frontend_spin(apart) < frontend_spun + 1.0

    # the same greedy text as an aggregated engine in this process (fp32 on CPU, bf16 on a GPU, as the stack's)
    from hpc.runtime.engine.torch.engine import TorchEngine
    from hpc.runtime.engine.types import SamplingParams
    from hpc.runtime.frontend.tokenizer import TextCodec

    codec = TextCodec(Path(tiny))

    async def direct() -> list[int]:
        ids = codec.encode(PROMPT)
        async with TorchEngine(tiny, AGG, {}, device="cuda:0" if torch.cuda.is_available() else "cpu") as engine:
            tokens = []
            async for out in engine.generate(GenerateRequest(request_id="d", token_ids=ids, sampling=SamplingParams(
                    max_tokens=12, ignore_eos=True))):
                tokens += out.token_ids
            return tokens

    assert body["choices"][0]["text"] == codec.decode(asyncio.run(direct()))


@pytest.mark.integration
def test_logprobs_and_the_prompts_scores_cross_the_links(apart):
    """Prompt logprobs from the prefill's engine process, the tokens' own from both: every field of an output
    crosses the link (msgspec), not only the tokens."""
    code, resp = post_json(apart.url + "/v1/completions", {"model": apart.model, "prompt": "one two three four",
                                                           "max_tokens": 4, "temperature": 0, "logprobs": 2,
                                                           "echo": True, "ignore_eos": True})
    assert code == 200, resp
    lp, n = resp["choices"][0]["logprobs"], resp["usage"]["prompt_tokens"]
    assert len(lp["token_logprobs"]) == n + 4 and lp["token_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(top) == 2 for top in lp["top_logprobs"][n:])  # the two best at each generated token
    plain = _complete(apart, prompt="one two three four", max_tokens=4)[1]["choices"][0]["text"]
    assert resp["choices"][0]["text"].endswith(plain)  # echo: the prompt, then the same greedy tokens


@pytest.mark.integration
def test_refusals_cross_back_as_the_engine_raised_them(apart):
    """A second engine process on the stack's manifest, driven directly: the request's fault is a ValueError
    (a 400 to the client), the prefill worker's answer keeps its code."""
    prefill = _state(apart, "prefill-0")["address"]

    async def drive() -> tuple[int, int]:
        async with EngineProcess(str(apart.run.path / "manifest.json"), "decode", 0, "cpu", 120) as engine:
            with pytest.raises(ValueError, match="empty prompt"):
                await engine.stream(GenerateRequest(request_id="e", token_ids=[]), lambda out: None)
            with pytest.raises(ValueError, match="empty prompt"):  # generate() raises what stream() does
                async for _ in engine.generate(GenerateRequest(request_id="g", token_ids=[])):
                    pass
            params = DisaggregatedParams(request_handle="no such handle", prefill_address=prefill,
                                         first_token_id=5, prompt_length=3)
            with pytest.raises(RemoteError, match="no KV cache waiting") as refused:
                await engine.stream(GenerateRequest(request_id="k", token_ids=[1, 2, 3],
                                                    disaggregated_params=params), lambda out: None)
            assert refused.value.code == 404
            stats = await engine.fresh_stats()
            assert stats["engine_pid"] == engine.pid != os.getpid() and stats["running"] == 0
            return engine.pid, int(stats["requests"])

    pid, requests = asyncio.run(drive())
    assert requests == 0  # neither reached the scheduler
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped with the `async with`


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU decodes the 250 tokens before the client can leave")
def test_a_client_that_goes_away_frees_its_slot_in_the_engine_process(apart):
    req = urllib.request.Request(apart.url + "/v1/completions", data=json.dumps(
        {"model": apart.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 250, "ignore_eos": True,
         "stream": True}).encode(), headers={"content-type": "application/json"})
    generated = _metric(apart, "decode-0", "hpc_worker_generated_tokens")
    resp = urllib.request.urlopen(req, timeout=30)
    resp.readline()
    deadline = time.monotonic() + 10
    while _metric(apart, "decode-0", "hpc_worker_running") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the first token is the prefill worker's: decoding starts a little later
    assert _metric(apart, "decode-0", "hpc_worker_running") == 1
    resp.close()  # the client goes away mid-stream: the worker drops it, the engine process frees the slot
    deadline = time.monotonic() + 10
    while _metric(apart, "decode-0", "hpc_worker_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(apart, "decode-0", "hpc_worker_running") == 0
    assert _metric(apart, "decode-0", "hpc_worker_generated_tokens") - generated < 249  # stopped, not finished
    assert _complete(apart)[0] == 200  # and serving goes on


@pytest.mark.integration
def test_a_dead_engine_process_fails_its_worker(apart):
    engine_pid = _state(apart, "decode-0")["engine_pid"]
    os.kill(engine_pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while _state(apart, "decode-0")["phase"] not in ("failed", "restarting") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(apart, "decode-0")["phase"] in ("failed", "restarting")
    log = (apart.run.logs / "decode-0.log").read_text()
    assert "engine failed: the engine process exited (code -9)" in log


@pytest.mark.integration
def test_an_engine_process_that_cannot_start_says_so_and_leaves_nothing(tmp_path):
    missing = tmp_path / "no such dir $(x)" / "manifest.json"

    async def start() -> EngineProcess:
        engine = EngineProcess(str(missing), "decode", 0, "cpu", 60)
        with pytest.raises(RuntimeError, match=r"before it was ready, the engine process exited \(code 1\)"):
            async with engine:
                pass
        return engine

    engine = asyncio.run(start())
    assert engine.returncode == 1 and engine.failure  # reaped, and the worker would see why


@pytest.mark.integration
def test_an_engine_that_fails_to_load_tells_its_worker_why(tmp_path):
    """The engine process sends its failure (Failed) before it exits: the worker's error, its state and the launch's
    verdict say what went wrong (a CUDA out-of-memory, here a model directory without its config), not only
    "exited (code 1)"."""
    from hpc import rundir
    from hpc.render.sbatch import render_sbatch
    from hpc.resolve import resolve

    empty = tmp_path / "no model here"
    empty.mkdir()
    run = rundir.create(resolve("local", "tiny-agg", ["model.generate=null", f"model.path={empty}"]), render_sbatch,
                        root=tmp_path / "runs")

    async def start() -> str:
        with pytest.raises(RuntimeError) as err:
            async with EngineProcess(str(run.manifest_path), "agg", 0, "cpu", 60):
                pass
        return str(err.value)

    said = asyncio.run(start())
    assert said.startswith("before it was ready, the engine process failed: FileNotFoundError: "), said
    assert f"{empty}/config.json" in said
