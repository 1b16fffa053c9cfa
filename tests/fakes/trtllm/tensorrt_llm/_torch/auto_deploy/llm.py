"""Upstream: tensorrt_llm/_torch/auto_deploy/llm.py — AutoDeploy's own LLM class; its __init__ sets
backend='_autodeploy' itself and its LlmArgs (auto_deploy/llm_args.py) shards by `world_size`: trtllm-bench
turns tensor_parallel_size into world_size before building it (bench/benchmark/utils/general.py). The fake
refuses the TorchLlmArgs fields AutoDeploy does not take (parallel sizes, scheduler, CUDA graphs, speculative
decoding, the cache transceiver)."""

from __future__ import annotations

from typing import Any

from tensorrt_llm.llmapi.llm import BaseLLM

NOT_TAKEN = {"tensor_parallel_size", "pipeline_parallel_size", "moe_expert_parallel_size", "enable_attention_dp",
             "scheduler_config", "cuda_graph_config", "speculative_config", "cache_transceiver_config",
             "disable_overlap_scheduler", "moe_config", "enable_chunked_prefill"}


class LLM(BaseLLM):
    BACKEND = "_autodeploy"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["backend"] = "_autodeploy"
        for key in kwargs:
            if key in NOT_TAKEN:
                raise ValueError(f"AutoDeploy LLM got invalid argument: {key}")
        super().__init__(*args, **kwargs)

    def _valid_keys(self) -> set[str]:
        return (super()._valid_keys() - NOT_TAKEN) | {"world_size", "compile_backend", "transforms"}
