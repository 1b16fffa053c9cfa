"""The worker's mirror of what its engine caches, resent to a router that starts late: applied after "cleared",
it gives that router the same answers as one that saw every live event."""

from __future__ import annotations

import pytest

from hpc.runtime.engine.torch.kv_records import KvRecord
from hpc.runtime.frontend.kv_index import KvIndex
from hpc.runtime.services import events
from hpc.runtime.services.events import KvMirror

pytestmark = pytest.mark.unit

BLOCK = 4
SHARED = list(range(100, 108))  # two blocks every prompt below starts with


def _stored(event_id: int, hashes: list[int], tokens: list[int], parent: int | None = None) -> dict:
    return KvRecord(event_id, BLOCK, hashes, parent, tokens).trtllm()  # the shape both engines publish


def _removed(event_id: int, hashes: list[int]) -> dict:
    return KvRecord(event_id, BLOCK, hashes).trtllm()


PROMPTS = [SHARED + [1, 2, 3, 4] + [5, 6, 7, 8], SHARED + [9, 9, 9, 9], list(range(200, 212))]
LIVE = [
    _stored(1, [11, 12, 13, 14], PROMPTS[0]),  # a chain of four
    _stored(2, [15], PROMPTS[1][8:], parent=12),  # a branch off its second block
    _stored(3, [21, 22], PROMPTS[2][:8]),
    _removed(4, [22]),  # a leaf evicted
    _stored(5, [22, 23], PROMPTS[2][4:], parent=21),  # and stored again with a block after it
    _removed(6, [21]),  # a chain's first block evicted: what follows it is out of any prompt's reach
    _stored(7, [31], [7, 7, 7, 7], parent=999),  # continues a chain the mirror never saw start
]


def _answers(index: KvIndex) -> list[tuple[int, dict[str, int]]]:
    return [index.overlaps(p) for p in PROMPTS + [SHARED, PROMPTS[2][4:]]]


def _mirror_and_live(records: list[dict]) -> tuple[KvMirror, KvIndex]:
    mirror, live = KvMirror(), KvIndex(BLOCK)
    for record in records:
        mirror.note(record)
        live.apply("agg-0", {"event": "engine", "record": record})
    return mirror, live


def test_a_resync_gives_a_late_router_what_the_live_events_gave():
    mirror, live = _mirror_and_live(LIVE)
    late = KvIndex(BLOCK)
    late.apply("agg-0", {"event": "cleared"})
    resent = mirror.records()
    for held in resent:
        late.apply("agg-0", {"event": "held", **held})
    assert _answers(late) == _answers(live)
    assert _answers(live)[:2] == [(4, {"agg-0": 4}), (3, {"agg-0": 3})]  # the shared start and both branches
    assert [h["block_hashes"] for h in resent] == [[11, 12], [13, 14], [15]]  # not the orphans 22, 23 and 31
    assert [h["parent_hash"] for h in resent] == [None, 12, 12]  # 11-12, then each branch off 12
    assert resent[1]["tokens"] == PROMPTS[0][8:] and resent[1]["block"] == BLOCK
    assert mirror.records() == resent and mirror.window == BLOCK


def test_a_resync_record_stays_under_its_token_bound_and_keeps_the_chain(monkeypatch):
    monkeypatch.setattr(events, "RESYNC_RECORD_TOKENS", 3 * BLOCK)
    tokens = list(range(1000, 1000 + 10 * BLOCK))
    mirror, live = _mirror_and_live([_stored(1, list(range(50, 60)), tokens)])
    resent = mirror.records()
    assert [len(h["block_hashes"]) for h in resent] == [3, 3, 3, 1]
    late = KvIndex(BLOCK)
    for held in resent:
        late.apply("agg-0", {"event": "held", **held})
    assert late.overlaps(tokens) == live.overlaps(tokens) == (10, {"agg-0": 10})


def test_a_parent_stored_again_after_its_child_still_comes_first():
    """Dict order is no help: a block evicted and stored again sits after the blocks that continue it."""
    mirror, live = _mirror_and_live([_stored(1, [1, 2], SHARED), _removed(2, [1]), _stored(3, [1], SHARED[:4])])
    assert list(mirror.blocks) == [2, 1]
    late = KvIndex(BLOCK)
    for held in mirror.records():
        late.apply("agg-0", {"event": "held", **held})
    assert late.overlaps(SHARED) == live.overlaps(SHARED) == (2, {"agg-0": 2})


def test_cleared_empties_the_mirror():
    mirror, _ = _mirror_and_live(LIVE)
    mirror.clear()
    assert mirror.records() == []


def test_a_resync_resends_each_attention_dp_ranks_blocks_as_that_rank():
    import asyncio

    publisher = events.EventPublisher.__new__(events.EventPublisher)
    publisher.component, publisher.nc, publisher.mirrors = "decode-0", None, {None: KvMirror()}
    sent = []
    publisher._publish = lambda kind, data: sent.append(data)
    for rank, tokens in ((0, PROMPTS[0]), (1, PROMPTS[2])):
        publisher.engine_kv_event({**_stored(rank + 1, [10 * rank + 1, 10 * rank + 2], tokens[:8]),
                                   "attention_dp_rank": rank})
    live = KvIndex(BLOCK)
    for data in sent:
        live.apply("decode-0", data)
    sent.clear()
    asyncio.run(publisher._resync(None))
    late = KvIndex(BLOCK)
    for data in sent:
        late.apply("decode-0", data)
    assert late.holders == live.holders and {h for held in late.holders.values() for h in held} == {
        "decode-0@0", "decode-0@1"}
