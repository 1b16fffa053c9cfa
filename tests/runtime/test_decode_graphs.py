"""Decode steps replayed per batch size: staged inputs, padded rows kept in the spare slot, eager fallback.

On CPU the fused decode kernels run under Triton's interpreter and a graph is stood in for by a capture that
keeps the step's output tensor and refills it on replay (tests/fakes/graphs.py). The real capture runs in
tests/runtime/test_engine_cuda.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from hpc.engine_args.cuda_graphs import GraphSizes
from hpc.runtime.engine.torch.decode_graphs import DecodeGraphs
from hpc.runtime.engine.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from tests.fakes.graphs import RecordedGraph

pytestmark = pytest.mark.unit

pytest.importorskip("triton", reason="Triton is not installed (the CI installs it for these tests)")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("without a GPU the fused kernels run only under TRITON_INTERPRET=1 (set in tests/conftest.py)",
                allow_module_level=True)

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
SLOTS = 6  # sequences' slots 0..5; slot 6 is the spare one padded rows write to


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG)
    init_weights(model, seed=5)
    return model.to(DEVICE).eval().fuse_projections().enable_fused_decode()


def _graphs(model, cache, sizes: GraphSizes) -> DecodeGraphs:
    step = lambda t, p, s: model.forward_step(model.embed(t), p, s, cache)  # noqa: E731
    return DecodeGraphs(step, sizes, scratch_slot=SLOTS, device=DEVICE)


def _random_caches(model, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A cache of random values and its copy: one for the eager steps, one for the graphs."""
    eager_cache = model.new_cache(SLOTS + 1, 32, torch.float32, DEVICE)
    for layer in eager_cache:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    return eager_cache, [layer.clone() for layer in eager_cache]


def test_padded_steps_give_the_eager_logits_and_touch_only_the_spare_slot() -> None:
    model = _model()
    gen = torch.Generator().manual_seed(1)
    eager_cache, graph_cache = _random_caches(model, gen)
    graphs = _graphs(model, graph_cache, GraphSizes((1, 4), padding=True))
    capture = RecordedGraph()
    graphs.capture(capture)
    assert capture.captured == [4, 1]  # largest first: the smaller graphs reuse its memory
    slots, positions = [4, 0, 2], [7, 12, 3]
    for step in range(2):  # the second step reads new inputs from the same buffers
        tokens = torch.randint(2, CFG.vocab_size, (3,), generator=gen).tolist()
        got = graphs.run(tokens, positions, slots)
        want = model.forward_step(model.embed(torch.tensor(tokens, device=DEVICE)[:, None]),
                                  torch.tensor(positions, device=DEVICE)[:, None], torch.tensor(slots, device=DEVICE),
                                  eager_cache)
        assert got.shape == (3, CFG.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for eager_layer, graph_layer in zip(eager_cache, graph_cache):
            torch.testing.assert_close(graph_layer[:, :SLOTS], eager_layer[:, :SLOTS], rtol=1e-5, atol=1e-5)
            assert not torch.equal(graph_layer[:, SLOTS, :, 0], eager_layer[:, SLOTS, :, 0])  # the padded row
        positions = [p + 1 for p in positions]
    assert graphs.replays == 2


def test_without_padding_a_size_with_no_graph_is_left_to_the_eager_step() -> None:
    model = _model()
    cache = model.new_cache(SLOTS + 1, 32, torch.float32, DEVICE)
    graphs = _graphs(model, cache, GraphSizes((1, 2), padding=False))
    graphs.capture(RecordedGraph())
    assert graphs.run([5, 6, 7], [1, 1, 1], [0, 1, 2]) is None
    assert graphs.run([5, 6], [1, 1], [0, 1]).shape == (2, CFG.vocab_size)
    assert graphs.replays == 1


def test_a_graph_that_picks_gives_its_logits_argmax_at_temperature_zero() -> None:
    from hpc.runtime.engine.torch.sampling import pick_in_graph

    model = _model()
    cache = model.new_cache(SLOTS + 1, 32, torch.float32, DEVICE)
    step = lambda t, p, s: model.forward_step(model.embed(t), p, s, cache)  # noqa: E731
    graphs = DecodeGraphs(step, GraphSizes((1, 4), padding=True), scratch_slot=SLOTS, device=DEVICE,
                          pick=pick_in_graph)
    graphs.capture(RecordedGraph())
    logits, picked = graphs.run_picking([5, 6, 7], [1, 1, 1], [0, 1, 2], temperatures=[0.0, 0.0, 0.0])
    assert picked.shape == (3,) and torch.equal(picked, logits.argmax(-1))
    # a step whose rows the graph does not pick for (top-k, top-p): its logits only
    assert graphs.run([5, 6, 7], [2, 2, 2], [0, 1, 2]).shape == (3, CFG.vocab_size)
    # temperatures ride the inputs as fixed point: a hot row draws, the greedy ones stay the argmax
    torch.manual_seed(0)
    draws = {int(graphs.run_picking([5, 6, 7], [3, 3, 3], [0, 1, 2], [0.0, 100.0, 0.0])[1][1]) for _ in range(20)}
    assert len(draws) > 5
    # a full step, then a padded one: the padded row writes the spare slot, not the slot the full step's last
    # row left in the staged inputs
    graphs.run([5, 6, 7, 8], [4, 4, 4, 4], [0, 1, 2, 3])
    slot_3 = [layer[:, 3].clone() for layer in cache]
    graphs.run([5, 6, 7], [5, 5, 5], [0, 1, 2])
    graphs.run([5, 6, 7], [6, 6, 6], [0, 1, 2])  # both staging buffers have held four rows now
    assert all(torch.equal(layer[:, 3], before) for layer, before in zip(cache, slot_3))
    assert graphs.replays == 25


def test_rows_going_on_take_the_last_picks_inside_the_graph_by_their_index() -> None:
    """run_picking's `sources`: a row's token is the pick of its row in the last replay that picked (still on the
    device), or the host's where its source is -1 — the logits of an eager step given those tokens."""
    from hpc.runtime.engine.torch.sampling import pick_in_graph

    model = _model()
    gen = torch.Generator().manual_seed(3)
    eager_cache, cache = _random_caches(model, gen)
    step = lambda t, p, s: model.forward_step(model.embed(t), p, s, cache)  # noqa: E731
    graphs = DecodeGraphs(step, GraphSizes((1, 4), padding=True), scratch_slot=SLOTS, device=DEVICE,
                          pick=pick_in_graph)
    graphs.capture(RecordedGraph())
    _, picked = graphs.run_picking([5, 6, 7], [4, 9, 2], [0, 1, 2], temperatures=[0.0] * 3)
    first = picked.tolist()
    model.forward_step(model.embed(torch.tensor([[5], [6], [7]], device=DEVICE)),
                       torch.tensor([[4], [9], [2]], device=DEVICE), torch.tensor([0, 1, 2], device=DEVICE),
                       eager_cache)
    # rows 2 and 0 go on from their picks (the host's tokens for them are stale: 0), a new row 3 joins with 11
    logits, _ = graphs.run_picking([0, 0, 11], [3, 5, 1], [2, 0, 3], temperatures=[0.0] * 3, sources=[2, 0, -1])
    want = model.forward_step(model.embed(torch.tensor([[first[2]], [first[0]], [11]], device=DEVICE)),
                              torch.tensor([[3], [5], [1]], device=DEVICE), torch.tensor([2, 0, 3], device=DEVICE),
                              eager_cache)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # without sources the host's tokens count again
    logits, _ = graphs.run_picking([0, 0, 11], [4, 6, 2], [2, 0, 3], temperatures=[0.0] * 3)
    want = model.forward_step(model.embed(torch.tensor([[0], [0], [11]], device=DEVICE)),
                              torch.tensor([[4], [6], [2]], device=DEVICE), torch.tensor([2, 0, 3], device=DEVICE),
                              eager_cache)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert graphs.covers(3) and graphs.covers(4) and not graphs.covers(5)


def test_graphs_that_make_their_own_copies_give_the_same_steps() -> None:
    """copies_in_graph (the engine's default): a graph per size and staging buffer copies its inputs in and its
    picks out itself; the steps equal the eager ones, tokens handed in on the device go in by index, and the host
    copy of the picks holds them."""
    from hpc.runtime.engine.torch.sampling import pick_in_graph

    model = _model()
    gen = torch.Generator().manual_seed(4)
    eager_cache, cache = _random_caches(model, gen)
    step = lambda t, p, s: model.forward_step(model.embed(t), p, s, cache)  # noqa: E731
    graphs = DecodeGraphs(step, GraphSizes((1, 4), padding=True), scratch_slot=SLOTS, device=DEVICE,
                          pick=pick_in_graph, copies_in_graph=True)
    capture = RecordedGraph()
    graphs.capture(capture)
    assert capture.captured == [4, 4, 1, 1]  # each size once per staging buffer

    def eager(tokens, positions, slots):
        return model.forward_step(model.embed(torch.tensor(tokens, device=DEVICE)[:, None]),
                                  torch.tensor(positions, device=DEVICE)[:, None],
                                  torch.tensor(slots, device=DEVICE), eager_cache)

    logits, picked = graphs.run_picking([5, 6, 7], [4, 9, 2], [0, 1, 2], temperatures=[0.0] * 3)
    torch.testing.assert_close(logits, eager([5, 6, 7], [4, 9, 2], [0, 1, 2]), rtol=1e-5, atol=1e-5)
    host, done = graphs.last_host_copy
    assert (done is None) == (DEVICE.type == "cpu")  # on a GPU, an event says when the host copy is complete
    if done is not None:
        done.synchronize()
    assert host.tolist() == picked.tolist() == logits.argmax(-1).tolist()
    first = picked.tolist()
    logits, _ = graphs.run_picking([0, 0, 11], [3, 5, 1], [2, 0, 3], temperatures=[0.0] * 3, sources=[2, 0, -1])
    torch.testing.assert_close(logits, eager([first[2], first[0], 11], [3, 5, 1], [2, 0, 3]), rtol=1e-5, atol=1e-5)
    given = torch.tensor([17, 23], device=DEVICE)  # an overlapped step's inputs gathered on the device
    logits, picked = graphs.run_picking([0, 0], [6, 2], [0, 3], temperatures=[0.0] * 2, device_tokens=given)
    torch.testing.assert_close(logits, eager([17, 23], [6, 2], [0, 3]), rtol=1e-5, atol=1e-5)
    host, done = graphs.last_host_copy
    if done is not None:
        done.synchronize()
    assert host.tolist() == picked.tolist() and graphs.replays == 3


def test_a_replay_runs_as_many_steps_as_keep_the_largest_batch_s_replay_short() -> None:
    from hpc.runtime.engine.torch.decode_graphs import SEVERAL_STEPS_BELOW_S, SEVERAL_STEPS_REPLAY_S, steps_for

    assert SEVERAL_STEPS_REPLAY_S == 2e-3 and SEVERAL_STEPS_BELOW_S == 0.5e-3
    # the tiny model's 128 rows on an H200 (0.143 ms): the most; then fewer as a step grows; one past the gate
    assert [steps_for(s * 1e-3, 8) for s in (0.143, 0.3, 0.45, 0.499, 0.5, 6.4)] == [8, 6, 4, 4, 1, 1]
    assert steps_for(0.1e-3, 3) == 3 and steps_for(1.2e-3, 8) == 1


def test_a_replay_of_several_steps_runs_each_from_the_picks_of_the_one_before() -> None:
    """steps=3: a second graph per size and buffer runs three steps, each from the one before's picks at the next
    position; the host copy holds every step's picks, the cache what three eager steps write. Where the largest
    batch's one-step replay is slow (the device bounds the step), only the one-step graphs are captured."""
    from hpc.runtime.engine.torch import decode_graphs
    from hpc.runtime.engine.torch.sampling import pick_in_graph

    model = _model()
    gen = torch.Generator().manual_seed(6)
    eager_cache, cache = _random_caches(model, gen)
    step = lambda t, p, s: model.forward_step(model.embed(t), p, s, cache)  # noqa: E731

    def made(replay_s: float) -> tuple[DecodeGraphs, RecordedGraph]:
        graphs = DecodeGraphs(step, GraphSizes((1, 4), padding=True), scratch_slot=SLOTS, device=DEVICE,
                              pick=pick_in_graph, copies_in_graph=True, steps=3)
        capture = RecordedGraph()
        graphs.capture(capture, timer=lambda replay: replay_s)
        return graphs, capture

    slow, capture = made(decode_graphs.SEVERAL_STEPS_BELOW_S)
    assert slow.steps == 1 and capture.captured == [4, 4, 1, 1] and not slow.covers_steps(3)
    graphs, capture = made(decode_graphs.SEVERAL_STEPS_BELOW_S / 5)
    assert graphs.steps == 3 and capture.captured == [4, 4, 1, 1, 4, 4, 1, 1] and graphs.covers_steps(3)
    tokens, positions, slots = [5, 6, 7], [4, 9, 2], [0, 1, 2]
    _, picked = graphs.run_picking(tokens, positions, slots, temperatures=[0.0] * 3, steps=3)
    host, done = graphs.last_host_copy
    if done is not None:
        done.synchronize()
    want = []
    for j in range(3):
        logits = model.forward_step(model.embed(torch.tensor(tokens, device=DEVICE)[:, None]),
                                    torch.tensor([p + j for p in positions], device=DEVICE)[:, None],
                                    torch.tensor(slots, device=DEVICE), eager_cache)
        tokens = logits.argmax(-1).tolist()
        want.append(tokens)
    assert host.tolist() == want and picked.tolist() == want[-1] and graphs.replays == 1
    for eager_layer, graph_layer in zip(eager_cache, cache):
        torch.testing.assert_close(graph_layer[:, :SLOTS], eager_layer[:, :SLOTS], rtol=1e-5, atol=1e-5)
    # the next replay's rows take the last step's picks by index (`sources`), as an overlapped launch's do
    _, again = graphs.run_picking([0, 0, 0], [p + 3 for p in positions], slots, temperatures=[0.0] * 3,
                                  sources=[0, 1, 2], steps=3)
    logits = model.forward_step(model.embed(torch.tensor(want[-1], device=DEVICE)[:, None]),
                                torch.tensor([p + 3 for p in positions], device=DEVICE)[:, None],
                                torch.tensor(slots, device=DEVICE), eager_cache)
    host, done = graphs.last_host_copy
    if done is not None:
        done.synchronize()
    assert host.tolist()[0] == logits.argmax(-1).tolist()


def test_each_size_keeps_the_graphs_of_its_faster_path() -> None:
    """Past MAX_BATCH rows a step may take the GEMVs or the batched matmuls (fused_decode.PATHS): each is captured
    and replayed, and the faster one's graphs are kept, for every staging buffer; a size with one path is captured
    once per buffer. The kept graphs step as the eager path does."""
    from hpc.runtime.engine.torch.sampling import pick_in_graph

    model = _model()
    fused = model.fused_decode
    gen = torch.Generator().manual_seed(6)
    eager_cache, cache = _random_caches(model, gen)
    step = lambda t, p, s: model.forward_step(model.embed(t), p, s, cache)  # noqa: E731
    graphs = DecodeGraphs(step, GraphSizes((1, 5, 6), padding=True), scratch_slot=SLOTS, device=DEVICE,
                          pick=pick_in_graph, copies_in_graph=True)
    recorded, captured = RecordedGraph(), []

    def capture(fn):
        replay, out = recorded(fn)
        replay.taken = (out[0].shape[0], fused.forced)  # the path the capture ran the step on
        captured.append(replay.taken)
        return replay, out

    seconds = {(6, "gemv"): 2.0, (6, "batched"): 1.0, (5, "gemv"): 1.0, (5, "batched"): 3.0}
    graphs.capture(capture, fused, timer=lambda replay: seconds[replay.taken])
    assert graphs.paths == {6: "batched", 5: "gemv"}
    assert graphs.timings == {6: {"gemv": 2.0, "batched": 1.0}, 5: {"gemv": 1.0, "batched": 3.0}}  # no size 1
    assert captured == [(6, "gemv"), (6, "batched"), (6, "batched"), (5, "gemv"), (5, "batched"), (5, "gemv"),
                        (1, None), (1, None)]
    assert [graphs._graphs[(size, turn)][0].taken for size in (6, 5) for turn in (0, 1)] == \
        [(6, "batched")] * 2 + [(5, "gemv")] * 2
    assert fused.forced is None  # the choice is the graphs': eager steps past MAX_BATCH stay batched
    logits, _ = graphs.run_picking([5, 6, 7, 8, 9], [4, 9, 2, 3, 1], [0, 1, 2, 3, 4], temperatures=[0.0] * 5)
    want = model.forward_step(model.embed(torch.tensor([5, 6, 7, 8, 9], device=DEVICE)[:, None]),
                              torch.tensor([4, 9, 2, 3, 1], device=DEVICE)[:, None],
                              torch.tensor([0, 1, 2, 3, 4], device=DEVICE), eager_cache)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
