"""Prefix reuse for the torch engine: full KV blocks of earlier prompts kept in a pool, found by chained hash.

A prompt is cut into blocks of `tokens_per_block` (kv_cache_config); block i's hash covers its tokens and block
i-1's hash, so a hash names a whole prefix. Prefill looks up the longest run of the prompt's leading blocks in
the pool, copies them into the request's cache slot and computes only the rest; afterwards the prompt's new
full blocks are copied into the pool (least recently used blocks make room). Every change is reported as a
KvRecord (kv_records.py), which its publisher turns into what TensorRT-LLM's get_kv_cache_events_async reports,
so one publisher and one router serve both engines.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from hpc.runtime.engine.block_hashes import block_hashes
from hpc.runtime.engine.torch.decode_graphs import Capture
from hpc.runtime.engine.torch.kv_records import KvRecord
from hpc.runtime.engine.models.llama import KvCache
from hpc.runtime.engine.torch.sampling import on_device, stage_into

COPY_GRAPH_BYTES = 64 << 20  # the most a captured pool copy gathers (the 8B shape: 16 blocks of 32 tokens)


class PrefixCache:
    def __init__(self, block: int, capacity: int, cache: KvCache,
                 on_events: Callable[[list[KvRecord]], None] | None = None) -> None:
        """`cache`: the engine's KV cache, [layers, 2, slots, kv_heads, max_len, head_dim] (blocks copy from and
        into a slot, every layer in one kernel); `capacity`: blocks the pool holds; `on_events`: the records of
        each store_all, in order, in one call (a prefill step's leave an engine process as one message)."""
        self.block, self.capacity, self.cache = block, capacity, cache.whole
        layers, two, _, heads, max_len, dim = self.cache.shape
        # row `capacity` is no block's: a graphed copy's padding writes there
        self.pool = self.cache.new_zeros((capacity + 1, layers, two, heads, block, dim))
        usable = max_len // block * block  # a slot's whole blocks: [layers, 2, slots, heads, blocks, block, dim]
        self._by_block = self.cache[:, :, :, :, :usable].unflatten(4, (usable // block, block))
        self._copies: dict[int, Callable[[], None]] = {}  # captured pool copies, by the blocks each takes
        # their static input (pool rows, slots, blocks), as wide as COPY_GRAPH_BYTES allows, made here and not in
        # capture_copies (the engine's warm-up runs in inference mode, whose tensors the scheduler could not fill)
        graphable = min(capacity, COPY_GRAPH_BYTES // (self.pool[0].numel() * self.pool.element_size()))
        self._copy_index = torch.zeros(3, 1 << graphable.bit_length() >> 1, dtype=torch.long, device=self.pool.device)
        self._copy_index[0].fill_(capacity)  # a capture's own eager run writes the spare row too
        self.copies_graphed = 0
        self.index: OrderedDict[int, int] = OrderedDict()  # block hash -> pool row, least recently used first
        self.free = list(range(capacity))
        self.on_events = on_events
        self.event_id = 0
        self._records: list[KvRecord] = []  # this store_all's, not handed over yet
        self._removed: list[int] = []  # evicted hashes not reported yet: one "removed" record for a run of them
        self.hits = self.lookups = 0  # blocks found / blocks looked for

    def match(self, tokens: list[int]) -> list[int]:
        """Pool rows of the prompt's longest cached run of leading blocks. The last token is always computed
        (its logits pick the first new token), so a prompt never matches whole."""
        rows = []
        wanted = block_hashes(tokens[:len(tokens) - 1], self.block)
        for h in wanted:
            row = self.index.get(h)
            if row is None:
                break
            self.index.move_to_end(h)
            rows.append(row)
        self.lookups += len(wanted)
        self.hits += len(rows)
        return rows

    def load(self, rows: list[int], slot: int) -> None:
        """The pool rows, in order, become the slot's first len(rows) blocks: one copy for every layer."""
        if not rows:
            return
        blocks = self.pool[on_device(rows, self.pool.device)]  # [n, layers, 2, heads, block, dim]
        n, layers, two, heads, b, dim = blocks.shape
        self.cache[:, :, slot, :, :n * b] = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, two, heads, n * b, dim)

    def store_all(self, prompts: list[tuple[list[int], int]]) -> None:
        """Keep each prompt's full blocks that the pool does not hold yet (their KV is in its slot now), in order,
        the KV of every new block copied in one indexed copy: a prefill step's prompts cost a few launches
        together, not a few each (every launch gives up the GIL, and the worker's event loop, busy under load, may
        keep it a while before the scheduler gets it back)."""
        b = self.block
        taken: dict[int, tuple[int, int]] = {}  # pool row -> (slot, block of its prompt) copied there
        for tokens, slot in prompts:
            # a run: new blocks in a row, from block `first`, the one before it `before`
            parent, run, first, before = None, [], 0, None
            for i, h in enumerate(block_hashes(tokens, b)):
                if h in self.index:  # held, or taken by an earlier prompt of this call: copied with it
                    self.index.move_to_end(h)
                    self._stored(run, before, tokens, first)  # a record is one chain: a block already held ends it
                    run = []
                else:
                    if not run:
                        first, before = i, parent
                    row = self._take()
                    taken[row] = (slot, i)  # a row taken twice (the pool full) keeps the later block
                    self.index[h] = row
                    run.append(h)
                parent = h
            self._stored(run, before, tokens, first)
        self._report_removed()
        records, self._records = self._records, []
        if records and self.on_events is not None:
            self.on_events(records)
        self._copy_in(taken)

    def capture_copies(self, capture: Capture, max_blocks: int) -> None:
        """The pool copy of up to 1, 2, 4, ... blocks as graphs, up to `max_blocks` (what one prefill step stores)
        and COPY_GRAPH_BYTES of gathered blocks (the graphs' pool keeps them): a copy is then one staged index copy
        and one replay, its padding written to the spare row. Eagerly, the indexing took 85-150 µs of the scheduler
        thread a prefill step on an H200; replayed, 35-100 (benchmarks/prefill_parts.py, the device idle)."""
        limit = min(max_blocks, self._copy_index.shape[1])
        sizes = [1 << i for i in range(limit.bit_length())]
        for size in reversed(sizes):  # largest first: the smaller ones reuse its memory
            rows, slots, blocks = self._copy_index[:, :size]
            self._copies[size] = capture(lambda r=rows, s=slots, k=blocks: self._copy(r, s, k))[0]

    def _copy(self, rows: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        self.pool[rows] = self._by_block[:, :, slots, :, blocks]  # the indexed dims lead: [n, layers, 2, heads, b, d]
        return rows  # a capture keeps its step's output tensor (decode_graphs.Capture); the pool is what it writes

    def _copy_in(self, taken: dict[int, tuple[int, int]]) -> None:
        """Each taken pool row gets its (slot, block)'s KV: one indexed copy for every block, prompt and layer (a
        4,096-token prompt of the 8B shape: one copy instead of 4,096 kernel launches); replayed from a graph
        where one holds that many."""
        if not taken:
            return
        rows, slots, blocks = list(taken), [s for s, _ in taken.values()], [i for _, i in taken.values()]
        size = next((n for n in sorted(self._copies) if n >= len(rows)), None)
        if size is None:
            self._copy(*on_device([rows, slots, blocks], self.pool.device))
            return
        pad = size - len(rows)  # into the spare row, from slot 0's first block
        stage_into(torch.tensor([rows + [self.capacity] * pad, slots + [0] * pad, blocks + [0] * pad]),
                   self._copy_index[:, :size])
        self._copies[size]()
        self.copies_graphed += 1

    def _stored(self, run: list[int], parent: int | None, tokens: list[int], first: int) -> None:
        """A run of new blocks (hashes) of `tokens`, from block `first`: as TensorRT-LLM sends them, the parent of
        the first block, then the blocks in order."""
        if run:
            self._report_removed()  # the evictions that made room come first
            self.event_id += 1
            b = self.block
            self._records.append(KvRecord(self.event_id, b, run, parent, tokens[first * b:(first + len(run)) * b]))

    def _take(self) -> int:
        if not self.free:
            gone, row = self.index.popitem(last=False)
            self._removed.append(gone)
            return row
        return self.free.pop()

    def _report_removed(self) -> None:
        """Evictions in a row as one record, as TensorRT-LLM's KVCacheEventManager::enqueueRemovedEvent adds a
        removed block to the last queued event when that is a removed one
        (cpp/tensorrt_llm/batch_manager/kvCacheEventManager.cpp): with a full pool every prompt stored evicts a
        block per block, and a record each made three messages a prompt where two do."""
        if self._removed:
            gone, self._removed = self._removed, []
            self.event_id += 1
            self._records.append(KvRecord(self.event_id, self.block, gone))
