"""Prefix reuse in the torch engine: a prompt that shares leading blocks with an earlier one computes only the
rest, answers exactly as without reuse, and every stored or evicted block is reported in TensorRT-LLM's record
shape."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hpc.runtime.engine.block_hashes import block_hashes, chain_hash
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit

SYSTEM = list(range(100, 180))  # 80 tokens: two full blocks of 32, and 16 more
BLOCK = 32


def _args(**kv) -> dict:
    return {"max_seq_len": 256, "max_batch_size": 4, "kv_cache_config": {"tokens_per_block": BLOCK, **kv}}


async def _answers(engine, prompts) -> list[tuple[list[int], int]]:
    out = []
    for ids in prompts:  # one after another: each sees what the earlier ones stored
        req = GenerateRequest(request_id="p", token_ids=ids, sampling=SamplingParams(max_tokens=6, temperature=0,
                                                                                      ignore_eos=True))
        outs = [o async for o in engine.generate(req)]
        out.append(([t for o in outs for t in o.token_ids], outs[-1].cached_tokens))
    return out


def test_hashes_chain_through_the_prefix():
    a, b = block_hashes(SYSTEM + [1] * 48, BLOCK), block_hashes(SYSTEM + [2] * 48, BLOCK)
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2]  # the shared two blocks hash alike
    assert chain_hash(None, SYSTEM[32:64]) != a[1]  # a block's hash depends on its parent


def test_hashes_are_the_published_ones():
    """Block hashes go out in KV events and routers compute them from prompts: the bytes hashed (parent as 8
    signed bytes, tokens as 4, little-endian, blake2b of 8 bytes, shifted to 63 bits) must not drift."""
    first = chain_hash(None, list(range(100, 132)))
    assert first == 7288874275499663020
    assert chain_hash(first, [2**32 - 1, 0, 128255, 7]) == 4705209579550837056


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_shared_prefix_is_reused_and_answers_do_not_change(tiny, device):
    prompts = [SYSTEM + [7, 8, 9], SYSTEM + [10, 11], SYSTEM[:40] + [12], SYSTEM[:32]]
    events = []

    async def run(**kv):  # fp32 on the GPU too: the two prefill paths must pick the same greedy tokens
        args = {**_args(**kv), "dtype": "float32"}
        async with TorchEngine(tiny, DisaggregationMode.AGG, args, device=device) as engine:
            engine.on_kv_event = events.append
            answers = await _answers(engine, prompts)
            await asyncio.sleep(0)  # events come over the loop
            return answers, engine.stats()

    (reused, stats), (plain, plain_stats) = asyncio.run(run()), asyncio.run(run(enable_block_reuse=False))
    assert [t for t, _ in reused] == [t for t, _ in plain]  # reuse changes nothing in the answers
    assert [c for _, c in reused] == [0, 64, 32, 0]  # a whole prompt never matches: its last token is computed
    assert stats["prompt_tokens_computed"] == sum(map(len, prompts)) - 96
    # the first prompt's two blocks, the only new ones, went into the pool by a captured copy on the GPU
    assert stats["prefix_copies_graphed"] == (1 if device == "cuda" else 0)
    assert plain_stats["prompt_tokens_computed"] == sum(map(len, prompts)) and "prefix_blocks_hit" not in plain_stats
    stored = [e["data"] for e in events if e["data"]["type"] == "stored"]
    assert len(stored) == 1 and stored[0]["parent_hash"] is None  # only the first prompt's two blocks were new
    assert [b["block_hash"] for b in stored[0]["blocks"]] == block_hashes(SYSTEM, BLOCK)
    assert [t["token_id"] for t in stored[0]["blocks"][1]["tokens"]] == SYSTEM[32:64]


def test_a_full_pool_evicts_the_least_recently_used_block_and_says_so(tiny):
    events = []

    async def run():
        async with TorchEngine(tiny, DisaggregationMode.AGG, _args(max_tokens=2 * BLOCK), device="cpu") as engine:
            engine.on_kv_event = events.append
            answers = await _answers(engine, [SYSTEM, [5] * 40, SYSTEM])
            await asyncio.sleep(0)
            return answers
    answers = asyncio.run(run())
    kinds = [(e["data"]["type"], len(e["data"].get("blocks") or e["data"].get("block_hashes"))) for e in events]
    # SYSTEM's 2 blocks; the 40 fives' block evicts SYSTEM's first; SYSTEM again finds nothing (a prefix is
    # reachable only from its first block) and makes room for both of its blocks by evicting the other two: one
    # record for both, as TensorRT-LLM merges evictions in a row
    assert kinds == [("stored", 2), ("removed", 1), ("stored", 1), ("removed", 2), ("stored", 2)]
    # least recently used first: SYSTEM's second block, then the fives'
    assert events[3]["data"]["block_hashes"] == [events[0]["data"]["blocks"][1]["block_hash"],
                                                 events[2]["data"]["blocks"][0]["block_hash"]]
    assert answers[2][1] == 0 and answers[2][0] == answers[0][0]
    assert [e["event_id"] for e in events] == list(range(1, 6))


def test_a_prefill_steps_records_leave_together_where_the_listener_takes_several(tiny):
    """An engine process's link takes a step's records as one message (on_kv_events): the same records, in the
    same order, as one by one."""
    batches, one_by_one = [], []

    async def run(batched: bool):
        async with TorchEngine(tiny, DisaggregationMode.AGG, _args(max_tokens=2 * BLOCK), device="cpu") as engine:
            if batched:
                engine.on_kv_events = batches.append
            else:
                engine.on_kv_event = one_by_one.append
            await _answers(engine, [SYSTEM, [5] * 40, SYSTEM])
            await asyncio.sleep(0)

    asyncio.run(run(True))
    asyncio.run(run(False))
    # a batch a prefill step, as the scheduler thread notes them (KvRecord): SYSTEM's blocks; the fives' eviction
    # and block; SYSTEM's two evictions and blocks
    assert [[r.tokens is None for r in batch] for batch in batches] == [[False], [True, False], [True, False]]
    assert [r.trtllm() for batch in batches for r in batch] == one_by_one  # made in TensorRT-LLM's form on the loop
    assert [r.event_id for batch in batches for r in batch] == list(range(1, 6))


def test_stored_blocks_hold_their_kv_even_from_a_prompt_longer_than_the_pool():
    from hpc.runtime.engine.models.llama import KvCache
    from hpc.runtime.engine.torch.prefix_cache import PrefixCache

    block, layers = 4, 3
    cache = KvCache(torch.randn(layers, 2, 2, 2, 32, 8))  # per layer [2, slots, kv heads, max_len, dim]
    pool = PrefixCache(block, capacity=3, cache=cache)
    tokens = list(range(100, 120))  # 5 full blocks into 3 rows: the first two are taken over by the last two
    pool.store_all([(tokens, 1)])
    hashes = [h for h in pool.index]
    assert len(hashes) == 3 and sorted(pool.index.values()) == [0, 1, 2]
    for i, h in zip((2, 3, 4), hashes):  # what each remaining block's row holds: that block of slot 1, every layer
        row = pool.index[h]
        for layer in range(layers):
            assert torch.equal(pool.pool[row, layer], cache[layer][:, 1, :, i * block:(i + 1) * block])
    # and a later prompt with the same first two blocks finds nothing (its first block was evicted), while
    # loading rows puts them back in order
    assert pool.match(tokens) == []
    pool.load([pool.index[hashes[0]], pool.index[hashes[1]]], slot=0)
    for layer in range(layers):
        assert torch.equal(cache[layer][:, 0, :, :2 * block], cache[layer][:, 1, :, 2 * block:4 * block])


def test_a_steps_prompts_are_stored_together_as_one_by_one(monkeypatch):
    """store_all of a prefill step's prompts (two sharing a block, max_len not a whole number of blocks) leaves
    the pool, the index and the records as storing them one by one does, in one copy for all of them."""
    from hpc.runtime.engine.torch import prefix_cache
    from hpc.runtime.engine.models.llama import KvCache
    from hpc.runtime.engine.torch.prefix_cache import PrefixCache

    block = 4
    whole = torch.randn(3, 2, 4, 2, 30, 8)  # [layers, 2, slots, kv heads, max_len 30 (7 blocks and 2), dim]
    shared = list(range(100, 108))
    prompts = [(shared + [1, 2, 3, 4, 5], 2), (shared + [9] * 6, 0), (list(range(200, 229)), 3)]
    pools, records = [], []
    copies = []
    copy_in = PrefixCache._copy_in
    monkeypatch.setattr(PrefixCache, "_copy_in", lambda self, taken: copies.append(len(taken)) or copy_in(self, taken))
    for together in (False, True):
        seen = []
        pool = PrefixCache(block, capacity=16, cache=KvCache(whole.clone()), on_events=seen.extend)
        if together:
            pool.store_all(prompts)
        else:
            for tokens, slot in prompts:
                pool.store_all([(tokens, slot)])
        pools.append(pool)
        records.append(seen)
    (one, both), (a, b) = pools, records
    assert one.index == both.index and a == b and torch.equal(one.pool, both.pool)
    assert copies == [3, 1, 7, 11]  # one by one: 3, 1 (its shared blocks held), 7; together: 11 in one copy
    # the second prompt's record: its one new block, the third, after the shared second (a run past block 0)
    second = prefix_cache.block_hashes(prompts[1][0], block)
    assert [(r.hashes, r.parent, r.tokens) for r in b][1] == ([second[2]], second[1], [9] * 4)
    assert b[1].trtllm()["data"]["blocks"][0]["tokens"][0] == {"type": "unique_token", "token_id": 9,
                                                               "token_extra_id": 0}
    for row, (slot, i) in ((both.index[h], (3, k)) for k, h in enumerate(prefix_cache.block_hashes(prompts[2][0],
                                                                                                   block))):
        assert torch.equal(both.pool[row], whole[:, :, slot, :, i * block:(i + 1) * block])


def test_graphed_pool_copies_store_what_the_eager_copy_does_their_padding_only_in_the_spare_row():
    """capture_copies: a store of n blocks replays the graph of the next power of two (the padding copies slot 0's
    first block into the spare row), and one past the largest graph copies eagerly; the pool's blocks are the
    eager copy's either way. On a GPU the engine captures them (test_a_shared_prefix_is_reused...)."""
    from hpc.runtime.engine.models.llama import KvCache
    from hpc.runtime.engine.torch.prefix_cache import PrefixCache
    from tests.fakes.graphs import RecordedGraph

    block = 4
    whole = torch.randn(2, 2, 4, 2, 30, 8)  # [layers, 2, slots, kv heads, max_len 30 (7 blocks and 2), dim]
    graphed = PrefixCache(block, capacity=32, cache=KvCache(whole.clone()))
    eager = PrefixCache(block, capacity=32, cache=KvCache(whole.clone()))
    capture = RecordedGraph()
    with torch.inference_mode():  # as the engine's warm-up captures them; its scheduler stores outside it
        graphed.capture_copies(capture, max_blocks=5)  # graphs of 4, 2 and 1 blocks: 8 would pass max_blocks
    assert capture.captured == [4, 2, 1]
    replayed = []
    graphed._copies = {n: (lambda n=n, replay=replay: replayed.append(n) or replay())
                       for n, replay in graphed._copies.items()}
    steps = [[(list(range(100, 104)), 1)],                                     # 1 block: the graph of 1
             [(list(range(200, 212)), 2)],                                     # 3: the graph of 4, one padded
             [(list(range(300, 308)), 0), (list(range(400, 412)), 3)],         # 5: past the largest, eagerly
             [(list(range(500, 508)), 3)]]                                     # 2: the graph of 2
    for step in steps:
        graphed.store_all(step)
        eager.store_all(step)
    assert replayed == [1, 4, 2] and graphed.copies_graphed == 3 and eager.copies_graphed == 0
    assert graphed.index == eager.index and len(graphed.index) == 11
    assert torch.equal(graphed.pool[:32], eager.pool[:32])  # every block's row, and the free ones untouched
    assert torch.equal(graphed.pool[32], whole[:, :, 0, :, :block])  # the padding: slot 0's first block
    assert not eager.pool[32].any()
