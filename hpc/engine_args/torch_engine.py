"""The torch reference engine's arguments, read once into one typed record.

The engine takes the LLM-API fields TensorRT-LLM takes (the same engine config means the same on both engines);
this is the subset it honours, each with the default TensorRT-LLM's llmapi/llm_args.py gives it, or the reference
engine's own where TensorRT-LLM has none (max_batch_size 32, max_seq_len 2048). An unset or zero value is the
default, as `int(args.get(key) or default)` read it before. Light (no torch): the launcher can show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hpc.engine_args.cuda_graphs import GraphSizes, decode_graph_sizes, prefill_graph_tokens
from hpc.engine_args.scheduling import ChunkingPolicy, chunking_policy, max_num_tokens, tokens_per_block

DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_SEQ_LEN = 2048
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class TorchEngineArgs:
    dtype: str = "auto"  # auto: bf16 on a GPU, fp32 on the CPU
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # the KV cache's slots: rows decoding at once
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN  # before the model's max_position_embeddings caps it
    stream_interval: int = 1  # a streamed output every N tokens (the first and the last always)
    batch_wait_timeout_iters: int = 0
    batch_wait_max_tokens_ratio: float = 0.0
    max_num_tokens: int = 8192  # a step's tokens, a decoding row's one included
    chunking: ChunkingPolicy | None = None  # enable_chunked_prefill's policy; None: prompts go whole
    tokens_per_block: int = 32  # the KV block: the prefix cache's unit and the chunk unit
    overlap_scheduler: bool = True  # not disable_overlap_scheduler
    block_reuse: bool = True  # kv_cache_config.enable_block_reuse
    kv_max_tokens: int | None = None  # kv_cache_config.max_tokens: the prefix pool (8 x max_seq_len when unset)
    decode_graphs: GraphSizes | None = None  # cuda_graph_config's batch sizes, up to max_batch_size
    prefill_graph_tokens: tuple[int, ...] | None = None  # torch_compile_config's piecewise graphs' token counts

    @classmethod
    def read(cls, args: Mapping[str, Any]) -> "TorchEngineArgs":
        """ValueError for a value the engine cannot run (an unknown dtype or chunking policy)."""
        dtype = str(args.get("dtype") or "auto")
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        max_batch = int(args.get("max_batch_size") or DEFAULT_MAX_BATCH_SIZE)
        budget = max_num_tokens(args)
        kv = args.get("kv_cache_config") or {}
        chunking = chunking_policy(args)
        unit = tokens_per_block(args)
        if chunking is not None and budget < unit:
            raise ValueError(f"enable_chunked_prefill: max_num_tokens ({budget}) is below one chunk "
                             f"(kv_cache_config.tokens_per_block, {unit}): no long prompt could start")
        return cls(dtype=dtype, max_batch_size=max_batch,
                   max_seq_len=int(args.get("max_seq_len") or DEFAULT_MAX_SEQ_LEN),
                   stream_interval=int(args.get("stream_interval") or 1),
                   batch_wait_timeout_iters=int(args.get("batch_wait_timeout_iters") or 0),
                   batch_wait_max_tokens_ratio=float(args.get("batch_wait_max_tokens_ratio") or 0.0),
                   max_num_tokens=budget, chunking=chunking, tokens_per_block=unit,
                   overlap_scheduler=not args.get("disable_overlap_scheduler"),
                   block_reuse=kv.get("enable_block_reuse") is not False,
                   kv_max_tokens=int(kv["max_tokens"]) if kv.get("max_tokens") else None,
                   decode_graphs=decode_graph_sizes(args, max_batch),
                   prefill_graph_tokens=prefill_graph_tokens(args, budget))
