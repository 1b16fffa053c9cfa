"""Engine-argument precedence, in one place.

    defaults derived from the recipe
  < the engine config YAML            (--extra-engine-args)
  < the override JSON                 (--override-engine-args, merged recursively)
  < values forced at run time         (backend 'pytorch' and kv_cache_config.event_buffer_max_size
                                       when KV events are published)

Each layer is merged into the previous with `deep_update`: mappings merge key by key, anything else
(lists included) replaces. Nothing here mutates its inputs.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Mapping

from hpc.spec.recipe import Recipe, RoleSpec

log = logging.getLogger(__name__)

KV_EVENT_BUFFER_MAX_SIZE = 1024

# Fields AutoDeploy's LlmArgs does not take: it shards by itself (world_size) and owns scheduling,
# CUDA graphs and speculative decoding. Dropped with one warning each.
AUTODEPLOY_UNSUPPORTED = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "moe_expert_parallel_size",
    "moe_tensor_parallel_size", "enable_attention_dp", "attention_dp_config", "cuda_graph_config",
    "disable_overlap_scheduler", "cache_transceiver_config", "speculative_config", "moe_config",
    "scheduler_config", "enable_chunked_prefill", "torch_compile_config", "load_format",
})


def deep_update(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: `update` merged over `base`, recursing into mappings present in both."""
    merged = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_update(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def recipe_defaults(recipe: Recipe, role: RoleSpec) -> dict[str, Any]:
    """The lowest layer: what the recipe's role shape and limits imply."""
    defaults: dict[str, Any] = {
        "tensor_parallel_size": role.tensor_parallel_size,
        "pipeline_parallel_size": role.pipeline_parallel_size,
        "max_seq_len": recipe.limits.max_input_tokens + recipe.limits.max_output_tokens,
    }
    if role.expert_parallel_size > 1:
        defaults["moe_expert_parallel_size"] = role.expert_parallel_size
    if role.enable_attention_dp:
        defaults["enable_attention_dp"] = True
    return defaults


def forced_values(*, publish_kv_events: bool) -> dict[str, Any]:
    """The top layer: what the runtime needs regardless of configuration."""
    if not publish_kv_events:
        return {}
    return {"backend": "pytorch", "kv_cache_config": {"event_buffer_max_size": KV_EVENT_BUFFER_MAX_SIZE}}


def merge_engine_args(defaults: Mapping[str, Any], extra: Mapping[str, Any] | None,
                      override: Mapping[str, Any] | None, forced: Mapping[str, Any]) -> dict[str, Any]:
    """The precedence chain documented at the top of this module."""
    merged = deep_update(defaults, extra or {})
    merged = deep_update(merged, override or {})
    return deep_update(merged, forced)


def prune_for_autodeploy(args: Mapping[str, Any],
                         warn: Callable[[str], None] = log.warning) -> dict[str, Any]:
    """A copy without the fields AutoDeploy rejects; one warning per dropped field."""
    kept = {}
    for key, value in args.items():
        if key in AUTODEPLOY_UNSUPPORTED:
            warn(f"backend _autodeploy does not support '{key}'; dropping it")
        else:
            kept[key] = copy.deepcopy(value)
    return kept
