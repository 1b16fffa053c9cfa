"""The overlap scheduler (TensorRT-LLM's, on unless disable_overlap_scheduler): a decode step launched from the
previous step's tokens while they are still on the device gives exactly the step-by-step answers — with requests
ending at different steps, by count, by a stop token read after the next step was launched, and at the cache's
length — and steps aside for rows that need their tokens on the host."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.torch import engine as engine_module
from hpc.runtime.engine.torch.core import EngineCore
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from hpc.spec.recipe import TorchEngineSpec
from tests.runtime.staggered import staggered as _staggered

# on a GPU the tests count steps as tokens: one step a replay (test_decode_multi_step.py: several)
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_step_a_replay")]

MAX_LEN = 64
PROMPTS = [[5, 6, 7, 8], [40, 41], [9] * 12, [100, 200, 300]]


async def _answers(model_dir, args: dict, requests: list[SamplingParams]) -> tuple[list[tuple], dict]:
    engine_args = {"max_seq_len": MAX_LEN, "max_batch_size": 8, **args}
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, engine_args) as engine:
        async def one(ids, sampling):
            outs = [out async for out in engine.generate(GenerateRequest(request_id="r", token_ids=ids,
                                                                         sampling=sampling))]
            return [t for out in outs for t in out.token_ids], outs[-1].finish_reason
        answers = await asyncio.gather(*(one(ids, p) for ids, p in zip(PROMPTS, requests)))
        return answers, engine.stats()


def _both(tiny, requests):
    overlapped, stats = asyncio.run(_answers(tiny, {}, requests))
    stepwise, plain = asyncio.run(_answers(tiny, {"disable_overlap_scheduler": True}, requests))
    assert plain.get("decode_steps_overlapped", 0) == 0
    return overlapped, stepwise, stats


def test_overlapped_steps_answer_as_step_by_step_ones(tiny):
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 3, 14, 1)]
    reference, _ = asyncio.run(_answers(tiny, {"disable_overlap_scheduler": True}, free))
    # a stop token the first request meets at its 5th token: read after the next step was already launched
    stop = reference[0][0][4]
    requests = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, stop_token_ids=[stop]), *free[1:]]
    # and one whose last token takes the cache's last position (12 + 51 = 63 of 64)
    requests[2] = SamplingParams(max_tokens=MAX_LEN - 12 - 1, temperature=0, ignore_eos=True)
    overlapped, stepwise, stats = _both(tiny, requests)
    assert overlapped == stepwise
    first_stop = reference[0][0].index(stop)
    assert overlapped[0] == (reference[0][0][:first_stop + 1], "stop")
    assert [len(tokens) for tokens, _ in overlapped[1:]] == [3, MAX_LEN - 12 - 1, 1]
    # every step ran from the device tokens of the one before, rows leaving the chain as they ended
    assert stats["decode_steps_overlapped"] == stats["decode_steps"] > 0, stats


def test_requests_join_a_chain_of_overlapped_steps(tiny, monkeypatch):
    # Requests arriving while others decode join the next step beside the rows going on from the device
    # tokens (TensorRT-LLM's overlap scheduler), with the answers step by step gives.
    def staggered(args: dict) -> tuple[list[list[int]], dict]:
        return asyncio.run(_staggered(tiny, {"max_seq_len": MAX_LEN, "max_batch_size": 8, **args}, PROMPTS,
                                      lambda i: 12 - 2 * i))

    overlapped, stats = staggered({})
    stepwise, _ = staggered({"disable_overlap_scheduler": True})
    assert overlapped == stepwise and [len(t) for t in overlapped] == [12, 10, 8, 6]
    assert stats["mixed_steps"] >= len(PROMPTS) - 1, stats  # each later prompt rode on a decode step: read first
    monkeypatch.setattr(engine_module, "DEFAULT_SWITCHES", TorchEngineSpec(mixed_steps=False))
    overlapped, stats = staggered({})  # prefilled apart, so that their rows join the chain in flight
    assert overlapped == stepwise
    assert stats["decode_rows_joined_in_flight"] >= len(PROMPTS) - 1, stats  # each later one joined a chain
    assert stats["decode_steps_overlapped"] == stats["decode_steps"], stats
    # each prompt's first token stayed on the device as its first decode step's input, read as that launched
    assert stats["first_tokens_left_on_device"] == len(PROMPTS), stats


def test_rows_that_need_their_tokens_on_the_host_step_by_step(tiny):
    greedy = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for _ in PROMPTS]
    with_logprobs = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2), *greedy[1:]]
    overlapped, stepwise, stats = _both(tiny, with_logprobs)
    assert overlapped == stepwise
    assert stats.get("decode_steps_overlapped", 0) == 0  # one row with logprobs keeps the whole batch step-wise
    assert stats.get("first_tokens_left_on_device", 0) < len(PROMPTS)  # its own first token is read at once
    sampled = [SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True) for _ in PROMPTS]
    answers, stats = asyncio.run(_answers(tiny, {}, sampled))
    assert [len(tokens) for tokens, _ in answers] == [7] * 4 and stats["decode_steps_overlapped"] > 0


def test_greedy_and_sampled_rows_in_one_overlapped_batch(tiny):
    mixed = [SamplingParams(max_tokens=8, temperature=t, ignore_eos=True) for t in (0, 1.0, 0, 0.7)]
    overlapped, stepwise, stats = _both(tiny, mixed)
    assert [overlapped[i] for i in (0, 2)] == [stepwise[i] for i in (0, 2)]  # the greedy rows, exactly
    assert [len(tokens) for tokens, _ in overlapped] == [8] * 4 and stats["decode_steps_overlapped"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_a_step_does_not_wait_for_the_device():
    # An overlapped step samples while the step before it still runs; a host wait in the sampler (as
    # torch.multinomial's validity checks are) would hold the scheduler until the device caught up.
    import time

    import torch

    from hpc.runtime.engine.torch.sampling import sample_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 4096, device="cuda")
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * 64
    sample_rows(logits, params, gen)  # kernels loaded
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued work
    t0 = time.perf_counter()
    tokens = sample_rows(logits, params, gen)
    returned_after = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    assert busy and returned_after < 0.2, f"sampling waited {returned_after:.3f} s for the device"
    assert tokens.shape == (64,) and int(tokens.max()) < 4096


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_small_copies_to_the_device_neither_wait_for_it_nor_reuse_a_buffer_too_soon():
    # on_device stages through a ring of pinned buffers: the copies queue behind the device's work without the
    # host waiting, and a buffer is written again only after the copy that read it ran (else that copy would
    # carry the later values)
    import time

    import torch

    from hpc.runtime.engine.torch.sampling import _PinnedRing, on_device

    device = torch.device("cuda")
    on_device([0], device)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of queued work
    t0 = time.perf_counter()
    first = [on_device([i, i + 1], device) for i in range(_PinnedRing.SLOTS)]
    returned_after = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    later = [on_device([i, -i], device) for i in range(3 * _PinnedRing.SLOTS)]  # round the ring: waits as needed
    assert busy and returned_after < 0.1, f"staging waited {returned_after:.3f} s for the device"
    assert [t.tolist() for t in first] == [[i, i + 1] for i in range(_PinnedRing.SLOTS)]
    assert [t.tolist() for t in later] == [[i, -i] for i in range(3 * _PinnedRing.SLOTS)]


class _Event:
    """A CUDA event's host side as `finish` uses it: whether it completed, and the waits it was asked for."""

    def __init__(self, completed: bool) -> None:
        self.completed, self.queries, self.waits = completed, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return self.completed

    def synchronize(self) -> None:
        self.waits += 1
        self.completed = True


def test_a_completed_event_is_not_waited_for_so_the_gil_is_kept():
    """torch's Event.synchronize gives up the GIL even for a completed event (query keeps it): a step's read, a
    pinned copy's slot and a KV handoff wait only for an event still running."""
    import torch

    from hpc.runtime.engine.host_wait import finish
    from hpc.runtime.engine.torch.overlap import InflightStep

    done, running = _Event(True), _Event(False)
    finish(done)
    finish(running)
    finish(None)
    assert (done.queries, done.waits) == (1, 0)
    assert (running.queries, running.waits) == (1, 1)
    step = InflightStep(rows=[], tokens=torch.tensor([3, 4]), host=torch.tensor([3, 4]), done=_Event(True))
    assert step.read() == [3, 4] and step.done.waits == 0
    step.done = _Event(False)
    assert step.read() == [3, 4] and step.done.waits == 1


def test_plain_decode_tokens_leave_bare_with_the_outputs_step_by_step_gives(tiny):
    """An overlapped step's tokens that end nothing leave as bare tokens (Emitter.send_tokens), not through
    _emit_token: every output equal, field for field, to the step-by-step path's (which never sends them bare),
    the ends (a stop token, the count, the cache's length) still sent whole with their reasons."""
    reference, _ = asyncio.run(_answers(tiny, {"disable_overlap_scheduler": True},
                                        [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)] * 4))
    requests = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, stop_token_ids=[reference[0][0][5]]),
                SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
                SamplingParams(max_tokens=MAX_LEN - 12 - 1, temperature=0, ignore_eos=True),
                SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)]  # never bare

    async def outputs(args: dict) -> tuple[list[list], dict]:
        engine_args = {"max_seq_len": MAX_LEN, "max_batch_size": 8, **args}
        async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, engine_args) as engine:
            async def one(ids, sampling):
                return [out async for out in engine.generate(GenerateRequest(request_id="r", token_ids=ids,
                                                                             sampling=sampling))]
            # the request with logprobs alone, after the others: it would keep their batch step-wise
            first = await asyncio.gather(*(one(ids, p) for ids, p in zip(PROMPTS[:3], requests[:3])))
            return [*first, await one(PROMPTS[3], requests[3])], engine.stats()

    overlapped, stats = asyncio.run(outputs({}))
    stepwise, plain = asyncio.run(outputs({"disable_overlap_scheduler": True}))
    assert overlapped == stepwise  # GenerateOutput structs: every field
    assert [out.finish_reason for out in (o[-1] for o in overlapped)] == ["stop", "length", "length", "length"]
    assert [len(o) for o in overlapped] == [6, 7, MAX_LEN - 12 - 1, 5]
    # the rows' middle tokens left bare: all but each request's first (it carries the prompt's figures) and last
    assert stats["decode_tokens_bare_total"] == (6 - 2) + (7 - 2) + (MAX_LEN - 12 - 1 - 2), stats
    assert plain.get("decode_tokens_bare_total", 0) == 0
    assert all(out.prompt_tokens == len(ids) for o, ids in zip(overlapped, PROMPTS) for out in o)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_steps_copy_to_the_host_is_complete_when_its_event_says_so_with_events_reused():
    # HostCopies records one event per buffer again and again: each step's (host, event) still tells when that
    # step's copy is complete, the copies queued behind the device's work without the host waiting
    import time

    import torch

    from hpc.runtime.engine.torch.overlap import HostCopies, InflightStep

    copies = HostCopies(8, torch.device("cuda"))
    steps = []
    for i in range(6):
        if i == 2:
            torch.cuda._sleep(1_000_000_000)  # about half a second of queued work before the third step's copy
        tokens = torch.full((4,), i, device="cuda")
        t0 = time.perf_counter()
        steps.append(InflightStep([], tokens, *copies.start(tokens)))
        assert time.perf_counter() - t0 < 0.1  # no wait for the device
        if len(steps) >= 2:  # as the scheduler: a step is read before its buffer comes round again
            assert steps[-2].read() == [i - 1] * 4
    assert steps[-1].read() == [5] * 4
    assert len({id(step.done) for step in steps}) == 2 and len(copies.events) == 2  # two events, reused


def test_a_first_token_left_on_the_device_goes_out_before_its_prompt_is_stored_in_the_prefix_cache(tiny):
    """The prompt's blocks go into the prefix cache at the iteration's end, after the decode step whose launch sends
    its first token: the hashes, the pool copy and the KV event records are not on the time to first token."""
    order: list[str] = []

    async def run() -> dict:
        engine_args = {"max_seq_len": MAX_LEN, "max_batch_size": 8}
        async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, engine_args) as engine:
            store, first = engine.core.slots.store, engine.core.first_token
            engine.core.slots.store = lambda prefix: (
                order.append(f"store {len(engine.core.slots.unstored)}"), store(prefix))[1]
            engine.core.first_token = lambda seq, *rest: (order.append("first token"), first(seq, *rest))[1]
            sampling = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            async for _ in engine.generate(GenerateRequest(request_id="r", token_ids=[7] * 40, sampling=sampling)):
                pass
            return {**engine.stats(), "blocks held": len(engine.core.prefix.match([7] * 40))}

    stats = asyncio.run(run())
    assert stats["first_tokens_left_on_device"] == 1, stats  # the path where the decode step's launch sends it
    assert order == ["first token", "store 1"], order
    assert stats["blocks held"] == 1  # stored all the same: 40 tokens, one whole block of 32


def test_a_plain_rows_bare_tokens_stop_where_end_of_says(tiny):
    """A plain row's bare-token test (Seq.ends_on, made once) is _end_of's: EOS unless ignored, each stop token,
    nothing else; a row that is not plain (a guide, logprobs) keeps _end_of's whole test."""
    engine = TorchEngine(tiny, DisaggregationMode.DECODE, {"max_seq_len": MAX_LEN})
    engine.load()
    eos = engine.core.cfg.eos_token_id

    def seq(**sampling):
        return engine._seq(GenerateRequest(request_id="r", token_ids=[5], sampling=SamplingParams(
            max_tokens=9, temperature=0, **sampling)), None, None)

    for made in (seq(), seq(ignore_eos=True), seq(stop_token_ids=[7, 8]), seq(ignore_eos=True, stop_token_ids=[9])):
        assert made.plain and made.max_tokens == 9
        for token in (eos, 7, 8, 9, 10):
            assert (token in made.ends_on) == (engine.core.end_of(made, token, 1) == "stop"), (made.ends_on, token)
    assert not seq(logprobs=1).plain  # its tokens go through _emit_token, with their logprobs


def test_the_running_rows_are_walked_only_after_one_ended_or_was_cancelled(tiny, monkeypatch):
    # A walk over every running row at every step (a call a row) was a twentieth of a decode engine's scheduler
    # time at c=64 on an H200; now only a step after a row ended or was cancelled walks them.
    walked: list[int] = []
    still = EngineCore.still_running
    monkeypatch.setattr(EngineCore, "still_running", lambda self, seq: walked.append(id(seq)) or still(self, seq))

    async def main():
        args = {"max_seq_len": MAX_LEN, "max_batch_size": 8}
        async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, args) as engine:
            long = GenerateRequest(request_id="long", token_ids=PROMPTS[0],
                                   sampling=SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            short = GenerateRequest(request_id="short", token_ids=PROMPTS[1],
                                    sampling=SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            cut = engine.generate(short)
            got = [await cut.__anext__() for _ in range(3)]
            kept = asyncio.create_task(_collect(engine, long))
            await cut.aclose()  # the client went away: engine.cancel from the loop's thread
            outs = await kept
            return got, outs, engine.stats(), len(engine.core.slots.free)

    got, outs, stats, free = asyncio.run(main())
    assert len(got) == 3 and sum(len(out.token_ids) for out in outs) == 40
    # the cancelled row stopped within a few steps (not at its 40th token), and both slots are free again
    assert stats["generated_tokens"] < 40 + 10 and free == 8, (stats["generated_tokens"], free)
    assert stats["decode_steps"] >= 38, stats
    # rows left twice (the cancelled one, the one that ran out); a walk each, of at most the two rows, and
    # never one a step
    assert 0 < len(walked) <= 6 and len(walked) < stats["decode_steps"] // 4, (len(walked), stats["decode_steps"])


async def _collect(engine, request):
    return [out async for out in engine.generate(request)]


def test_the_walk_that_drops_a_cancelled_row_asks_for_no_other(tiny):
    # a row released by the walk itself is gone from the rows already: no walk at the next step for it, while a
    # row released anywhere else (a finish) asks for one
    engine = TorchEngine(tiny, DisaggregationMode.DECODE, {"max_seq_len": MAX_LEN})
    engine.load()

    def seated(request_id: str):
        seq = engine._seq(GenerateRequest(request_id=request_id, token_ids=[5], sampling=SamplingParams(
            max_tokens=9, temperature=0)), None, None)
        seq.slot = engine.core.slots.free.pop()
        return seq

    cancelled, finished = seated("c"), seated("f")
    engine.core.leaving = 0
    engine.cancel(cancelled)
    assert engine.core.leaving == 1
    engine.core.leaving = 0  # as the scheduler resets it before it walks
    assert not engine.core.still_running(cancelled) and cancelled.slot == -1 and engine.core.leaving == 0
    engine.core.release(finished)
    assert finished.slot == -1 and engine.core.leaving == 1


@pytest.mark.parametrize("overlap", [True, False])
def test_min_tokens_keeps_a_stop_token_from_ending_the_answer_before_it(tiny, overlap):
    """min_tokens (vLLM's and TensorRT-LLM's extension, which AIPerf and MLPerf harnesses send): a stop token or
    EOS met before that many tokens ends nothing; met after, it ends the answer as before."""
    reference, _ = asyncio.run(_answers(tiny, {"disable_overlap_scheduler": True},
                                        [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]))
    tokens = reference[0][0]
    stop = tokens[1]  # met at the 2nd token
    later = next(i for i, t in enumerate(tokens) if i >= 6 and t == stop) if stop in tokens[6:] else None
    asked = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
             SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)]
    (plain,), _ = asyncio.run(_answers(tiny, {"disable_overlap_scheduler": not overlap}, asked[:1]))
    (pinned,), _ = asyncio.run(_answers(tiny, {"disable_overlap_scheduler": not overlap}, asked[1:]))
    assert plain == (tokens[:2], "stop")
    assert pinned[0] == tokens[:len(pinned[0])] and len(pinned[0]) >= 6  # the same tokens, not stopped at 2
    assert pinned == ((tokens[:later + 1], "stop") if later is not None else (tokens, "length"))
