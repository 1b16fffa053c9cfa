"""Several decode steps in one graph replay (DecodeGraphs' `steps`, the recipe's torch_engine.decode_steps_per_graph):
each step's picks are the next one's tokens inside the replay, and the host emits a row's tokens of all of them at
once. The answers are the step-by-step ones — rows ending by count, by a stop token and at the cache's end between
a replay's steps, requests joining mid-chain — and a row's tokens leave in order, never split between bare tokens
and whole outputs.

On the CPU a graph is stood in for by a capture that reruns the step (tests/fakes/graphs.py), so the engine's
decode graphs run here as on a GPU, their steps eager."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.torch import decode_graphs

from hpc.runtime.engine.torch import warmup
from hpc.runtime.engine.torch import engine as engine_module
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from hpc.spec.recipe import TorchEngineSpec
from tests.fakes.graphs import RecordedGraph
from tests.runtime.staggered import staggered as _staggered

pytestmark = pytest.mark.unit

MAX_LEN = 64
STEPS = 4
PROMPTS = [[5, 6, 7, 8], [40, 41], [9] * 12, [100, 200, 300]]


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """Decode graphs stood in for (prefill stays eager), `steps` a replay as the test sets it. On a GPU the
    stand-in's replay is the eager step, slower than a graph's: its time does not choose the steps (steps_for;
    on two H200 it chose two, not the test's four)."""
    monkeypatch.setattr(TorchEngine, "_graphable",
                        lambda self, prefill=False: not prefill and self.mode is not DisaggregationMode.PREFILL)
    monkeypatch.setattr(warmup, "cuda_capture", lambda device: RecordedGraph())
    monkeypatch.setattr(decode_graphs, "steps_for", lambda one_step_s, most: most)

    def steps(count: int, **switches: bool) -> None:
        monkeypatch.setattr(engine_module, "DEFAULT_SWITCHES", TorchEngineSpec(decode_steps_per_graph=count,
                                                                               **switches))
    return steps


async def _outputs(model_dir, args: dict, requests: list[SamplingParams], alone_last: bool = False):
    engine_args = {"max_seq_len": MAX_LEN, "max_batch_size": 8, **args}
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, engine_args) as engine:
        async def one(ids, sampling):
            return [out async for out in engine.generate(GenerateRequest(request_id="r", token_ids=ids,
                                                                         sampling=sampling))]
        together = len(requests) - 1 if alone_last else len(requests)
        outs = await asyncio.gather(*(one(ids, p) for ids, p in zip(PROMPTS, requests[:together])))
        if alone_last:  # after the others: a request with logprobs keeps its batch step by step
            outs.append(await one(PROMPTS[len(outs)], requests[-1]))
        return outs, engine.stats()


def _tokens(outs) -> list[int]:
    return [t for out in outs for t in out.token_ids]


def _answer(outs) -> tuple:
    """A request's outputs as its client reads them: the tokens and their logprobs in order, and the last output's
    fields (a replay's bare tokens of one row come as one output, step by step as one each)."""
    last = outs[-1]
    return (_tokens(outs), [lp for out in outs for lp in out.logprobs or []], last.finished, last.finish_reason,
            last.prompt_tokens, last.cached_tokens, last.disaggregated_params,
            [o.prompt_logprobs for o in outs if o.prompt_logprobs])


@pytest.mark.parametrize("steps", [STEPS, 8])  # eight: the most a replay runs by default (DECODE_STEPS_PER_GRAPH)
def test_a_replay_of_several_steps_answers_as_step_by_step(tiny, stand_in_graphs, steps):
    stand_in_graphs(1)
    reference, _ = asyncio.run(_outputs(tiny, {"disable_overlap_scheduler": True},
                                        [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 4))
    # a stop token first met at the 13th token or later (mid-replay, in a replay whose tokens would otherwise leave
    # bare), a count that is no multiple of the steps, the cache's last position (12 + 51 = 63 of 64), and
    # logprobs (never bare, never on the device)
    first = _tokens(reference[0])
    stop_at = next(i for i in range(12, 19) if first[i] not in first[:i])
    requests = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[first[stop_at]]),
                SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
                SamplingParams(max_tokens=MAX_LEN - 12 - 1, temperature=0, ignore_eos=True),
                SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)]
    stepwise, plain = asyncio.run(_outputs(tiny, {"disable_overlap_scheduler": True}, requests, alone_last=True))
    stand_in_graphs(steps)
    several, stats = asyncio.run(_outputs(tiny, {}, requests, alone_last=True))
    assert [_answer(o) for o in several] == [_answer(o) for o in stepwise]
    assert all(len(out.token_ids) == 1 for o in stepwise for out in o)
    # a replay's bare tokens of a row leave as one output: the third row's 51 mostly `steps` at a time
    chunks = [len(out.token_ids) for out in several[2]]
    assert chunks.count(steps) >= 40 // steps, chunks
    assert all(len(out.token_ids) == 1 for out in several[3])  # logprobs: every token an output of its own
    assert [out.finish_reason for out in (o[-1] for o in several)] == ["stop", "length", "length", "length"]
    assert [len(_tokens(o)) for o in several] == [stop_at + 1, 7, MAX_LEN - 12 - 1, 5]
    assert plain.get("decode_launches_multi_step_total", 0) == 0
    # the third row's 51 decode tokens went mostly `steps` a replay, and the middle tokens left bare
    assert stats["decode_launches_multi_step_total"] >= 40 // steps, stats
    assert stats["decode_tokens_bare_total"] >= 48 - 2 * steps, stats
    assert stats["decode_steps"] < stats["generated_tokens"] // 2, stats


def test_one_request_decodes_four_tokens_a_launch(tiny, stand_in_graphs):
    sampling = [SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)]
    stand_in_graphs(1)
    one_a_step, single = asyncio.run(_outputs(tiny, {}, sampling))
    stand_in_graphs(STEPS)
    several, stats = asyncio.run(_outputs(tiny, {}, sampling))
    assert _tokens(several[0]) == _tokens(one_a_step[0]) and len(_tokens(several[0])) == 33
    assert single["decode_steps"] == 32 and single.get("decode_launches_multi_step_total", 0) == 0, single
    # its 32 decode tokens: 8 launches of 4 (the first from the prefill's token on the device)
    assert stats["decode_steps"] == stats["decode_launches_multi_step_total"] == 8, stats


def test_requests_join_a_chain_of_several_steps_a_replay(tiny, stand_in_graphs):
    def staggered(args: dict) -> tuple[list[list[int]], dict]:
        return asyncio.run(_staggered(tiny, {"max_seq_len": MAX_LEN, "max_batch_size": 8, **args}, PROMPTS,
                                      lambda i: 20 - 3 * i))

    # prompts prefilled apart, so that their rows join the chain in flight (a mixed step reads the chain first)
    stand_in_graphs(STEPS, mixed_steps=False)
    several, stats = staggered({})
    stepwise, _ = staggered({"disable_overlap_scheduler": True})
    assert several == stepwise and [len(t) for t in several] == [20, 17, 14, 11]
    assert stats["decode_rows_joined_in_flight"] >= len(PROMPTS) - 1, stats
    assert stats["decode_launches_multi_step_total"] > 0, stats


def test_sampled_rows_draw_each_step_of_a_replay(tiny, stand_in_graphs):
    stand_in_graphs(STEPS)
    sampled = [SamplingParams(max_tokens=11, temperature=1.0, ignore_eos=True) for _ in PROMPTS]
    outs, stats = asyncio.run(_outputs(tiny, {}, sampled))
    answers = [_tokens(o) for o in outs]
    assert [len(tokens) for tokens in answers] == [11] * 4
    assert stats["decode_launches_multi_step_total"] > 0, stats
    # draws, not one token repeated: a replay's steps each drew (4 rows x 10 decode tokens of a 4,096 vocabulary)
    assert len({t for tokens in answers for t in tokens[1:]}) > 20, answers


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_real_graphs_of_several_steps_answer_as_graphs_of_one(tiny, monkeypatch):
    """On the GPU: CUDA graphs of four steps a replay (the fused kernels, the picks and their copies captured)
    give the greedy tokens of one step a replay."""
    requests = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 30, 17, 2)]
    monkeypatch.setattr(engine_module, "DEFAULT_SWITCHES", TorchEngineSpec(decode_steps_per_graph=1))
    one, single = asyncio.run(_outputs(tiny, {}, requests))
    monkeypatch.setattr(engine_module, "DEFAULT_SWITCHES", TorchEngineSpec(decode_steps_per_graph=STEPS))
    several, stats = asyncio.run(_outputs(tiny, {}, requests))
    assert [_tokens(o) for o in several] == [_tokens(o) for o in one]
    assert [len(_tokens(o)) for o in several] == [9, 30, 17, 2]
    assert single.get("decode_launches_multi_step_total", 0) == 0 and single["decode_steps_graphed"] > 0, single
    assert stats["decode_launches_multi_step_total"] >= 6 and stats["decode_steps"] <= 12, stats
