"""Engine-argument precedence, in one place.

    defaults derived from the recipe
  < the engine config YAML            (--extra-engine-args)
  < the override JSON                 (--override-engine-args, merged recursively)
  < values forced at run time         (TensorRT-LLM: kv_cache_config.event_buffer_max_size and
                                       enable_iter_perf_stats when KV events and metrics are published)

then, for backend '_autodeploy', the fields AutoDeploy does not take are pruned (tensor_parallel_size becomes
its world_size). The result is exactly what the engine receives; the manifest stores it.

Each layer is merged into the previous with `deep_update`: mappings merge key by key, anything else
(lists included) replaces. Nothing here mutates its inputs.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Mapping

from hpc.spec.base import deep_update  # noqa: F401 (this module's layers are merged with it)
from hpc.spec.recipe import Backend, Recipe, RoleSpec

log = logging.getLogger(__name__)

KV_EVENT_BUFFER_MAX_SIZE = 100_000  # as Dynamo's TensorRT-LLM worker: a busy engine's events between drains

# Dynamo's TensorRT-LLM worker turns on dynamic batch tuning; so do we (the defaults layer, so users can change it).
DYNAMIC_BATCH_CONFIG = {"enable_batch_size_tuning": True, "enable_max_num_tokens_tuning": False,
                        "dynamic_batch_moving_average_window": 128}

# The reference engine's own defaults. Prefill steps from CUDA graphs (cuda_graphs.prefill_graph_tokens): off by
# default in TensorRT-LLM, whose piecewise graphs go through torch.compile; the torch engine captures its whole
# prefill in about a second. Decode graphs padded (as this repo's TensorRT-LLM decode configs set it): without,
# only batches of 1-32 and 64 rows have a graph, and under load a served batch is rarely exactly 64 — the stack's
# decode worker at c=64 ran most steps eagerly (py-spy, docs/performance-log.md).
TORCH_ENGINE_DEFAULTS = {"torch_compile_config": {"enable_piecewise_cuda_graph": True},
                         "cuda_graph_config": {"enable_padding": True}}

# Fields AutoDeploy's LlmArgs does not take: it shards by itself (world_size) and owns scheduling,
# CUDA graphs and speculative decoding. Dropped with one warning each.
AUTODEPLOY_UNSUPPORTED = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "moe_expert_parallel_size",
    "moe_tensor_parallel_size", "enable_attention_dp", "attention_dp_config", "cuda_graph_config",
    "disable_overlap_scheduler", "cache_transceiver_config", "speculative_config", "moe_config",
    "scheduler_config", "enable_chunked_prefill", "torch_compile_config", "load_format",
})


def recipe_defaults(recipe: Recipe, role: RoleSpec, trtllm: bool = False) -> dict[str, Any]:
    """The lowest layer: what the recipe's role shape and limits imply (and TensorRT-LLM's scheduler as Dynamo
    sets it up: no eviction of running requests, dynamic batch tuning)."""
    defaults: dict[str, Any] = {
        "tensor_parallel_size": role.tensor_parallel_size,
        "pipeline_parallel_size": role.pipeline_parallel_size,
        "max_seq_len": recipe.limits.max_input_tokens + recipe.limits.max_output_tokens,
    }
    if role.expert_parallel_size > 1:
        defaults["moe_expert_parallel_size"] = role.expert_parallel_size
    if role.enable_attention_dp:
        defaults["enable_attention_dp"] = True
    if recipe.backend is Backend.TORCH:
        defaults.update(copy.deepcopy(TORCH_ENGINE_DEFAULTS))
    if trtllm:
        defaults["scheduler_config"] = {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT",
                                        "dynamic_batch_config": dict(DYNAMIC_BATCH_CONFIG)}
    return defaults


def forced_values(*, publish_kv_events: bool, backend: str = "pytorch") -> dict[str, Any]:
    """The top layer: what the runtime needs regardless of configuration. With events on, TensorRT-LLM must
    buffer KV events (get_kv_cache_events_async yields nothing otherwise) and, on the PyTorch backend, keep
    iteration stats (get_stats_async yields nothing without enable_iter_perf_stats)."""
    if not publish_kv_events:
        return {}
    forced: dict[str, Any] = {"kv_cache_config": {"event_buffer_max_size": KV_EVENT_BUFFER_MAX_SIZE}}
    if backend != "_autodeploy":
        forced["enable_iter_perf_stats"] = True
    return forced


def overridden(merged: Mapping[str, Any], forced: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Where the forced layer replaces a value the user set: 'path: user -> forced' for each."""
    changes = []
    for key, value in forced.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            changes += overridden(merged[key], value, f"{path}.")
        elif key in merged and merged[key] != value:
            changes.append(f"{path}: {merged[key]!r} -> {value!r}")
    return changes


def merge_engine_args(defaults: Mapping[str, Any], extra: Mapping[str, Any] | None,
                      override: Mapping[str, Any] | None, forced: Mapping[str, Any]) -> dict[str, Any]:
    """The precedence chain documented at the top of this module."""
    merged = deep_update(defaults, extra or {})
    merged = deep_update(merged, override or {})
    return deep_update(merged, forced)


def prune_for_autodeploy(args: Mapping[str, Any],
                         warn: Callable[[str], None] = log.warning) -> dict[str, Any]:
    """A copy without the fields AutoDeploy rejects; one warning per dropped field. AutoDeploy shards by
    `world_size`, so a tensor_parallel_size > 1 carries over to it (as trtllm-bench does)."""
    kept = {}
    tp = args.get("tensor_parallel_size")
    if isinstance(tp, int) and tp > 1 and "world_size" not in args:
        kept["world_size"] = tp
    for key, value in args.items():
        if key in AUTODEPLOY_UNSUPPORTED:
            warn(f"backend _autodeploy does not support '{key}'; dropping it")
        else:
            kept[key] = copy.deepcopy(value)
    return kept
