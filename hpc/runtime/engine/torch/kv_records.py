"""A prefix-cache change as the torch engine's scheduler thread notes it, and its TensorRT-LLM form.

The scheduler thread notes a change as a few ints (`KvRecord`): the TensorRT-LLM form, a dict per token of every
stored block, took 15-22 µs a prompt there (a tenth of a prefill step at c=64 on an H200, with its encoding for the
engine process's link). Whoever publishes the record makes that form (`trtllm()`), off the scheduler's thread: the
worker that reads the link, or the event loop an in-process engine hands its records to.
"""

from __future__ import annotations

from typing import Any, Callable

from msgspec import Struct


class KvRecord(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    event_id: int
    block: int  # tokens a block (TensorRT-LLM's record calls it window_size)
    hashes: list[int]  # the stored blocks' hashes in order, or the removed ones
    parent: int | None = None  # stored: the hash of the block before the first
    tokens: list[int] | None = None  # stored: the blocks' tokens, block after block; None: removed

    def trtllm(self) -> dict[str, Any]:
        """As tensorrt_llm/_utils.py KVCacheEventSerializer serializes a KVCacheEvent: {"event_id", "data":
        {"type": "stored", "parent_hash", "blocks": [{"type": "stored_block", "block_hash", "tokens": [{"type":
        "unique_token", "token_id", "token_extra_id"}], "lora_id", "cache_level", "priority"}]} or {"type":
        "removed", "block_hashes"}, "window_size"}."""
        if self.tokens is None:
            data: dict[str, Any] = {"type": "removed", "block_hashes": list(self.hashes)}
        else:
            b, tokens = self.block, self.tokens
            data = {"type": "stored", "parent_hash": self.parent, "blocks": [
                {"type": "stored_block", "block_hash": h, "lora_id": None, "cache_level": 0, "priority": 35,
                 "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                            for t in tokens[i * b:(i + 1) * b]]}
                for i, h in enumerate(self.hashes)]}
        return {"event_id": self.event_id, "data": data, "window_size": self.block}


def publish_each(listener: Callable[[dict[str, Any]], None], records: list[KvRecord]) -> None:
    """Each record, in order, to a listener of TensorRT-LLM's records (the worker's NATS publisher)."""
    for record in records:
        listener(record.trtllm())
