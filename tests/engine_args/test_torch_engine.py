"""The torch engine's arguments, read once: TensorRT-LLM's defaults, a zero as unset, what it cannot run refused."""

from __future__ import annotations

import pytest

from hpc.engine_args.scheduling import ChunkingPolicy
from hpc.engine_args.torch_engine import TorchEngineArgs

pytestmark = pytest.mark.unit


def test_nothing_set_reads_as_the_defaults():
    args = TorchEngineArgs.read({})
    assert args == TorchEngineArgs(prefill_graph_tokens=None, decode_graphs=args.decode_graphs)
    assert (args.max_batch_size, args.max_seq_len, args.max_num_tokens, args.tokens_per_block) == (32, 2048, 8192, 32)
    assert args.overlap_scheduler and args.block_reuse and args.chunking is None and args.kv_max_tokens is None


def test_each_field_is_read_from_its_llm_api_key():
    args = TorchEngineArgs.read({
        "dtype": "float32", "max_batch_size": 4, "max_seq_len": 0, "stream_interval": 3, "max_num_tokens": 64,
        "enable_chunked_prefill": True, "scheduler_config": {"context_chunking_policy": "EQUAL_PROGRESS"},
        "kv_cache_config": {"tokens_per_block": 16, "enable_block_reuse": False, "max_tokens": 512},
        "disable_overlap_scheduler": True, "batch_wait_timeout_iters": 2, "batch_wait_max_tokens_ratio": 0.5,
        "cuda_graph_config": {"batch_sizes": [1, 2, 8]},
        "torch_compile_config": {"enable_piecewise_cuda_graph": True, "capture_num_tokens": [32, 128]}})
    assert args.dtype == "float32" and args.max_batch_size == 4 and args.max_seq_len == 2048  # 0: the default
    assert args.stream_interval == 3 and args.chunking is ChunkingPolicy.EQUAL_PROGRESS and args.tokens_per_block == 16
    assert not args.block_reuse and args.kv_max_tokens == 512 and not args.overlap_scheduler
    assert (args.batch_wait_timeout_iters, args.batch_wait_max_tokens_ratio) == (2, 0.5)
    assert args.decode_graphs is not None and args.decode_graphs.batch_sizes == (1, 2)  # none above the batch
    assert args.prefill_graph_tokens == (32,)  # none above max_num_tokens


@pytest.mark.parametrize("engine_args, message", [
    ({"dtype": "fp8"}, "dtype: 'fp8' is not one of auto, float32, bfloat16, float16"),
    ({"enable_chunked_prefill": True, "max_num_tokens": 16}, "below one chunk"),
    ({"enable_chunked_prefill": True, "scheduler_config": {"context_chunking_policy": "FORCE_CHUNK"}},
     "FORCE_CHUNK"),
])
def test_what_the_engine_cannot_run_is_refused_by_name(engine_args, message):
    with pytest.raises(ValueError, match=message):
        TorchEngineArgs.read(engine_args)
