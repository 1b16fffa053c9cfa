"""Prefill steps replayed per token count: prompts packed in one row answer as each prefilled alone, padded tokens
stay in the spare slot, what no graph holds runs eagerly, and the engine takes the graphs only for prompts from
position 0.

A graph is stood in for on the CPU by tests/fakes/graphs.py; the real capture runs in tests/runtime/test_engine_cuda.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from hpc.runtime.engine.torch import warmup
from hpc.runtime.engine.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from hpc.runtime.engine.torch.prefill_graphs import PrefillGraphs
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from tests.fakes.graphs import RecordedGraph

pytestmark = pytest.mark.unit

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
SLOTS, MAX_LEN = 6, 32  # sequences' slots 0..5; slot 6 is the spare one padded tokens write to
CPU = torch.device("cpu")


def _model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG)
    init_weights(model, seed=5)
    return model.eval().fuse_projections()


def _graphs(model, cache, counts: tuple[int, ...], max_prompts: int) -> PrefillGraphs:
    def step(tokens, positions, slots, prompts, last):
        return model.forward_step(model.embed(tokens[None]), positions[None], slots[None], cache, last=last,
                                  packed=prompts)
    return PrefillGraphs(step, counts, max_prompts, SLOTS, MAX_LEN, CPU)


def _alone(model, cache, prompt: list[int], slot: int) -> torch.Tensor:
    """The eager prefill of one prompt from position 0."""
    return model.forward_step(model.embed(torch.tensor([prompt])), torch.arange(len(prompt))[None],
                              torch.tensor([slot]), cache)[0]


def test_packed_prompts_answer_as_each_alone_and_padding_touches_only_the_spare_slot() -> None:
    model = _model()
    eager_cache = model.new_cache(SLOTS + 1, MAX_LEN, torch.float32, CPU)
    graph_cache = [layer.clone() for layer in eager_cache]
    graphs = _graphs(model, graph_cache, (4, 16, 32), max_prompts=8)
    capture = RecordedGraph()
    graphs.capture(capture)
    assert capture.captured == [8, 8, 4]  # largest first; a graph of 4 tokens holds at most 4 prompts
    gen = torch.Generator().manual_seed(3)
    for lengths, slots in (([7, 1, 5], [4, 0, 2]), ([2, 9], [1, 5])):  # 13 tokens -> 16, then 11 -> 16 again
        prompts = [torch.randint(2, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        got = graphs.run(prompts, slots)
        assert got.shape == (len(prompts), CFG.vocab_size)
        for row, prompt, slot in zip(got, prompts, slots):
            torch.testing.assert_close(row, _alone(model, eager_cache, prompt, slot), rtol=1e-5, atol=1e-5)
        for eager_layer, graph_layer in zip(eager_cache, graph_cache):
            torch.testing.assert_close(graph_layer[:, :SLOTS], eager_layer[:, :SLOTS], rtol=1e-5, atol=1e-5)
            assert graph_layer[:, SLOTS].abs().sum() > 0 and eager_layer[:, SLOTS].abs().sum() == 0
    assert graphs.replays == 2


def test_more_tokens_or_prompts_than_a_graph_holds_are_left_to_the_eager_step() -> None:
    model = _model()
    graphs = _graphs(model, model.new_cache(SLOTS + 1, MAX_LEN, torch.float32, CPU), (4, 8), max_prompts=2)
    graphs.capture(RecordedGraph())
    assert graphs.run([[5] * 9], [0]) is None  # 9 tokens: no graph that large
    assert graphs.run([[5], [6], [7]], [0, 1, 2]) is None  # 3 prompts: the graphs hold 2 rows of logits
    assert graphs.run([[5, 6, 7], [8, 9]], [0, 1]).shape == (2, CFG.vocab_size)
    assert graphs.replays == 1


PROMPTS = [[5, 6, 7], [3] * 19, [42, 43, 44, 45, 46, 47, 48], list(range(200, 240)) + [7, 8]]
GRAPHS_ON = {"torch_compile_config": {"enable_piecewise_cuda_graph": True, "capture_num_tokens": [8, 64]}}


async def _answers(model_dir, args: dict, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    engine = TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {"max_seq_len": 128, "max_batch_size": 8,
                                                                     "kv_cache_config": {"tokens_per_block": 32},
                                                                     **args})

    async def one(ids: list[int]) -> list[int]:
        req = GenerateRequest(request_id="p", token_ids=ids, sampling=SamplingParams(max_tokens=4, temperature=0,
                                                                                      ignore_eos=True))
        return [t async for out in engine.generate(req) for t in out.token_ids]
    async with engine:
        answers = [await one(ids) for ids in prompts]
        return answers, engine.stats()


def test_the_engine_prefills_from_graphs_and_answers_as_the_eager_engine(tiny, monkeypatch) -> None:
    eager, eager_stats = asyncio.run(_answers(tiny, {}, PROMPTS + PROMPTS[-1:]))
    assert "prefill_steps_graphed" not in eager_stats
    # on the CPU: prefill graphs only (decode graphs need the GPU's fused kernels), captured by the stand-in
    monkeypatch.setattr(TorchEngine, "_graphable", lambda self, prefill=False: prefill)
    monkeypatch.setattr(warmup, "cuda_capture", lambda device: RecordedGraph())
    graphed, stats = asyncio.run(_answers(tiny, GRAPHS_ON, PROMPTS + PROMPTS[-1:]))
    assert graphed == eager
    # every prompt from position 0 ran in a graph; the repeated one took its first block from the prefix cache,
    # so it ran eagerly
    assert stats["prefill_steps"] == 5 and stats["prefill_steps_graphed"] == 4
    assert stats["prompt_tokens_cached"] == 32
