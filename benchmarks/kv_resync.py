"""What a KV-aware router's resync costs: a worker resending every block it holds (hpc.runtime.services.events
KvMirror), as the bytes it publishes and the time its event loop spends; the router applying them (KvIndex).

    python benchmarks/kv_resync.py [--blocks 1000,24000] [--block-tokens 32]

24,000 blocks of 32 tokens is about what an 8B model's KV cache holds on one H200 (~100 GB at 128 kB a token).
Prompts of 16 blocks sharing their first 4 (a system prompt), as a chat workload's cache looks.
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec

from hpc.runtime.engine.torch.kv_records import KvRecord
from hpc.runtime.frontend.kv_index import KvIndex
from hpc.runtime.services.events import KvMirror

PROMPT_BLOCKS, SHARED_BLOCKS = 16, 4


def filled(blocks: int, block_tokens: int) -> tuple[KvMirror, list[dict]]:
    """A mirror holding `blocks` blocks, and the TensorRT-LLM records that filled it (the live events)."""
    rng = random.Random(0)
    shared = [rng.randrange(128_000) for _ in range(SHARED_BLOCKS * block_tokens)]
    mirror, records, next_hash = KvMirror(), [], 1
    shared_hashes = list(range(next_hash, next_hash + SHARED_BLOCKS))
    next_hash += SHARED_BLOCKS
    records.append(KvRecord(0, block_tokens, shared_hashes, None, shared).trtllm())
    while next_hash <= blocks:
        n = min(PROMPT_BLOCKS - SHARED_BLOCKS, blocks - next_hash + 1)
        tokens = [rng.randrange(128_000) for _ in range(n * block_tokens)]
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        records.append(KvRecord(len(records), block_tokens, hashes, shared_hashes[-1], tokens).trtllm())
    for record in records:
        mirror.note(record)
    return mirror, records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", default="1000,24000")
    parser.add_argument("--block-tokens", type=int, default=32)
    args = parser.parse_args()
    encode = msgspec.json.Encoder().encode
    print(f"{'blocks':>7} {'resync MB':>9} {'as live MB':>10} {'messages':>8} {'worker ms':>9} {'router ms':>9} "
          f"{'same answers':>12}")
    for blocks in (int(b) for b in args.blocks.split(",")):
        mirror, records = filled(blocks, args.block_tokens)
        start = time.perf_counter()
        held = mirror.records()
        payloads = [encode({"event": "held", "worker": "agg-0", **h}) for h in held]
        worker_ms = (time.perf_counter() - start) * 1e3
        live_bytes = sum(len(encode({"event": "engine", "worker": "agg-0", "record": r})) for r in records)
        late, live = KvIndex(args.block_tokens), KvIndex(args.block_tokens)
        start = time.perf_counter()
        for payload in payloads:
            late.apply("agg-0", msgspec.json.decode(payload))
        router_ms = (time.perf_counter() - start) * 1e3
        for record in records:
            live.apply("agg-0", {"event": "engine", "record": record})
        same = late.holders == live.holders
        print(f"{blocks:>7} {sum(map(len, payloads)) / 1e6:>9.2f} {live_bytes / 1e6:>10.2f} {len(payloads):>8} "
              f"{worker_ms:>9.1f} {router_ms:>9.1f} {str(same):>12}")


if __name__ == "__main__":
    main()
