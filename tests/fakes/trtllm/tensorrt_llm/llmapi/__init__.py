"""Upstream: tensorrt_llm/llmapi/__init__.py exports these names."""

from tensorrt_llm._fake_args import CapacitySchedulerPolicy, ContextChunkingPolicy  # noqa: F401
from tensorrt_llm.disaggregated_params import DisaggregatedParams  # noqa: F401
from tensorrt_llm.llmapi.llm import (LLM, CacheTransceiverConfig, DecodingBaseConfig, DynamicBatchConfig,  # noqa: F401
                                     KvCacheConfig, MoeConfig, SchedulerConfig)
from tensorrt_llm.llmapi.mm_encoder import MultimodalEncoder  # noqa: F401
from tensorrt_llm.sampling_params import SamplingParams  # noqa: F401
