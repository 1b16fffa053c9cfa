"""How many prompt tokens a step takes, and whether a long prompt is split: TensorRT-LLM's meaning, which the torch
engine follows too (so one engine config means the same on both engines).

- `max_num_tokens` (TorchLlmArgs, default 8192): a step's tokens, a decoding row's one included;
- `enable_chunked_prefill` (default off): a prompt that does not fit what is left is prefilled in chunks;
  without it, the LLM API refuses a prompt longer than max_num_tokens (LLM._check_arguments);
- the chunk unit is `kv_cache_config.tokens_per_block` (py_executor_creator: `chunk_unit_size =
  tokens_per_block`), and `scheduler_config.context_chunking_policy` picks how the budget is shared,
  FIRST_COME_FIRST_SERVED when unset (ContextChunkingPolicy in llmapi/llm_args.py).

Light (no torch): the launcher validates with it, the engine reads it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Mapping

DEFAULT_MAX_NUM_TOKENS = 8192
DEFAULT_TOKENS_PER_BLOCK = 32


class ChunkingPolicy(str, Enum):
    """The policies the torch engine runs (TensorRT-LLM also has FORCE_CHUNK, for its branch snapshots)."""
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"


def max_num_tokens(engine_args: Mapping[str, Any]) -> int:
    return int(engine_args.get("max_num_tokens") or DEFAULT_MAX_NUM_TOKENS)


def chunking_policy(engine_args: Mapping[str, Any]) -> ChunkingPolicy | None:
    """None when prompts go whole; ValueError for a policy the torch engine does not run."""
    if not engine_args.get("enable_chunked_prefill"):
        return None
    policy = (engine_args.get("scheduler_config") or {}).get("context_chunking_policy")
    return ChunkingPolicy(policy or ChunkingPolicy.FIRST_COME_FIRST_SERVED)


def tokens_per_block(engine_args: Mapping[str, Any]) -> int:
    """The KV block: the prefix cache's unit and the chunk unit."""
    return int((engine_args.get("kv_cache_config") or {}).get("tokens_per_block") or DEFAULT_TOKENS_PER_BLOCK)
