"""Which worker holds which prompt prefixes, built from the workers' KV events (the cache-aware router's view).

Workers publish TensorRT-LLM-shaped records (see hpc.runtime.engine.torch.prefix_cache): per-block "stored" with the
block's tokens and its parent's hash, "removed" with block hashes, and a worker-level "cleared" when it starts.
The index re-hashes each stored block from its tokens with the chain the engines' prompts are cut by, so the
engine's own hash values (TensorRT-LLM's are internal) need only map to ours, per worker.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from hpc.runtime.engine.block_hashes import block_hashes, chain_hash, with_mm_keys
from hpc.runtime.services.events import block_mm_keys

log = logging.getLogger(__name__)


RANK_MARK = "@"


def holder(worker: str, rank: int | None) -> str:
    """Who holds a block: a worker ("prefill-0"), or one attention-DP rank of it ("prefill-0@3")."""
    return worker if rank is None else f"{worker}{RANK_MARK}{rank}"


class KvIndex:
    def __init__(self, block: int) -> None:
        self.block = block
        self.holders: dict[int, set[str]] = {}  # our block hash -> workers holding it
        # worker -> (engine block hash -> our hash); per worker, so that forgetting one (its "cleared", sent again
        # on every resync) costs its own blocks, not every worker's
        self.ours: dict[str, dict[int, int]] = {}
        self.stale = True  # no event stream yet (or it broke): route by load until events flow
        self.events = 0
        self.resyncs = 0  # the workers asked to resend what they hold (at the start, and when NATS came back)

    def apply(self, worker: str, message: dict[str, Any]) -> None:
        """One message from a worker's kv_events subject (hpc.runtime.services.events.EventPublisher): "cleared",
        an engine's record, or "held" (blocks a worker resends on a resync, their tokens as one flat list)."""
        self.events += 1
        event = message.get("event")
        if event == "cleared":
            self.forget(worker)
            return
        rank = message.get("attention_dp_rank", (message.get("record") or {}).get("attention_dp_rank"))
        worker = holder(worker, rank)
        if event == "held":
            b, tokens, mm = message["block"], message["tokens"], message.get("mm") or {}
            self._store(worker, message.get("parent_hash"),
                        ((h, tokens[i * b:(i + 1) * b], tuple(mm.get(str(i), ())))
                         for i, h in enumerate(message["block_hashes"])))
            return
        data = (message.get("record") or {}).get("data") or {}
        if data.get("type") == "stored":
            self._store(worker, data.get("parent_hash"),
                        ((blk["block_hash"], [t["token_id"] for t in blk.get("tokens") or []], block_mm_keys(blk))
                         for blk in data.get("blocks") or []))
        elif data.get("type") == "removed":
            held = self.ours.get(worker, {})
            for engine_hash in data.get("block_hashes") or []:
                ours = held.pop(engine_hash, None)
                if ours is not None:
                    self._release(ours, worker)

    def _store(self, worker: str, engine_parent: int | None,
               blocks: Iterable[tuple[int, list[int], tuple[str, ...]]]) -> None:
        """A chain of blocks (engine hash, tokens, the images' hashes) after the block `engine_parent` (None: a
        prompt's start). A block with an image gets a hash no text prompt has (with_mm_keys): two images behind the
        same placeholder tokens are two prefixes, not one cached one."""
        held = self.ours.setdefault(worker, {})
        parent = None if engine_parent is None else held.get(engine_parent)
        if engine_parent is not None and parent is None:
            return  # continues a chain whose start this index never saw: not reachable from a prompt
        for engine_hash, tokens, mm_keys in blocks:
            if len(tokens) != self.block:
                break  # a partial block is not reused
            parent = with_mm_keys(chain_hash(parent, tokens), mm_keys)
            held[engine_hash] = parent
            self.holders.setdefault(parent, set()).add(worker)

    def forget(self, worker: str) -> None:
        """A worker's blocks, those of each of its attention-DP ranks too."""
        for key in [k for k in self.ours if k == worker or k.startswith(worker + RANK_MARK)]:
            for ours in self.ours.pop(key, {}).values():
                self._release(ours, key)

    @property
    def indexed(self) -> int:
        """(worker, block) pairs the index holds."""
        return sum(len(held) for held in self.ours.values())

    def reset(self) -> None:
        """The event stream broke: what was missed cannot be known, so start over (and route by load)."""
        self.holders.clear()
        self.ours.clear()
        self.stale = True

    def _release(self, ours: int, worker: str) -> None:
        held = self.holders.get(ours)
        if held is not None:
            held.discard(worker)
            if not held:
                del self.holders[ours]

    def overlaps(self, tokens: list[int]) -> tuple[int, dict[str, int]]:
        """(the prompt's full blocks, per worker the blocks it holds of the prompt's start, in a row)."""
        hashes = block_hashes(tokens, self.block)
        run: dict[str, int] = {}
        for i, h in enumerate(hashes):
            held = [w for w in self.holders.get(h, ()) if run.get(w, 0) == i]
            if not held:
                break
            for w in held:
                run[w] = i + 1
        return len(hashes), run
