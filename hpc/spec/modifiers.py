"""Config modifiers (seed 000's appendix; Dynamo's profiler config modifiers for TensorRT-LLM): turn one role of a
disaggregated recipe into an aggregated recipe and back, and set a role's parallel layout — all through the
override layer (`override_engine_args`), so the role's engine-config file is never touched, precedence and
validation still apply, and a conversion undoes exactly what it did.

What a role needs to run aggregated, as the profiler sets it:
- from prefill: no block reuse (a prefill-only profile must compute every prompt), the overlap scheduler back on
  (prefill configs turn it off), no cache transceiver (nothing to hand off);
- from decode: block reuse on (a decode-only profile skips prefill by reusing it), no cache transceiver, and
  chunked prefill on: a decode config's max_num_tokens (128-256) is far below the prompts it decodes, and without
  chunking the engine refuses a prompt longer than that (TensorRT-LLM's LLM._check_arguments).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from hpc.spec.base import deep_update
from hpc.spec.recipe import Recipe, Roles, RoleSpec

Source = Literal["prefill", "decode"]

AGG_FROM: dict[str, dict[str, Any]] = {
    "prefill": {"kv_cache_config": {"enable_block_reuse": False}, "disable_overlap_scheduler": False,
                "cache_transceiver_config": None},
    "decode": {"kv_cache_config": {"enable_block_reuse": True}, "cache_transceiver_config": None,
               "enable_chunked_prefill": True},
}
_MARK = "hpc_converted_from"  # in the recipe's description: which role an aggregated recipe came from


def to_agg(recipe: Recipe, source: Source, pool: str | None = None) -> Recipe:
    """The `source` role of a disaggregated recipe as the one aggregated role (same workers, same file); of a role
    with pools, the one `pool` (what a profile of that pool runs), without the global router."""
    role = getattr(recipe.roles, source)
    if role is None:
        raise ValueError(f"the recipe has no {source} role to convert")
    if role.pools or pool is not None:
        names = recipe.roles.pools(source)
        if pool not in names:
            raise ValueError(f"roles.{source} has pools ({', '.join(names) or 'none'}); name the one to convert")
        role = recipe.roles.spec(pool)
    overrides = deep_update(role.override_engine_args or {}, AGG_FROM[source])
    agg = role.model_copy(update={"override_engine_args": overrides})
    frontend = recipe.frontend.model_copy(update={"global_router": None})
    return recipe.model_copy(update={
        "name": f"{recipe.name}-{pool or source}-agg"[:64], "roles": Roles(agg=agg, encode=recipe.roles.encode),
        "frontend": frontend, "description": f"{recipe.description} [{_MARK}: {source}]".strip()})


def to_disagg(recipe: Recipe, target: Source, other: RoleSpec | None = None) -> Recipe:
    """An aggregated recipe's role back as the `target` role, its aggregated-only overrides removed; `other` is
    the opposite role (prefill for a decode target and back), kept as it is."""
    role = recipe.roles.agg
    if role is None:
        raise ValueError("the recipe has no agg role to convert")
    overrides = _without(role.override_engine_args or {}, AGG_FROM[target])
    back = role.model_copy(update={"override_engine_args": overrides or None})
    roles = {"encode": recipe.roles.encode, target: back}
    if other is not None:
        roles["decode" if target == "prefill" else "prefill"] = other
    name = recipe.name.removesuffix(f"-{target}-agg")
    description = recipe.description.replace(f" [{_MARK}: {target}]", "").replace(f"[{_MARK}: {target}]", "")
    return recipe.model_copy(update={"name": name, "roles": Roles(**roles), "description": description})


def with_parallel(recipe: Recipe, role_name: str, *, tp: int | None = None, pp: int | None = None,
                  ep: int | None = None, attention_dp: bool | None = None) -> Recipe:
    """A role's layout set in the recipe (GPUs per worker, the plan) and in its override layer (the engine), so
    the two agree and validation checks the result like any recipe."""
    role = getattr(recipe.roles, role_name)
    if role is None:
        raise ValueError(f"the recipe has no {role_name} role")
    fields: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for value, field, key in ((tp, "tensor_parallel_size", "tensor_parallel_size"),
                              (pp, "pipeline_parallel_size", "pipeline_parallel_size"),
                              (ep, "expert_parallel_size", "moe_expert_parallel_size"),
                              (attention_dp, "enable_attention_dp", "enable_attention_dp")):
        if value is not None:
            fields[field] = value
            engine[key] = value
    fields["override_engine_args"] = deep_update(role.override_engine_args or {}, engine)
    roles = recipe.roles.model_copy(update={role_name: role.model_copy(update=fields)})
    return recipe.model_copy(update={"roles": roles})


def _without(overrides: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """`overrides` less the keys `added` set to the same values (nested), empty mappings dropped."""
    out = copy.deepcopy(overrides)
    for key, value in added.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            rest = _without(out[key], value)
            if rest:
                out[key] = rest
            else:
                del out[key]
        elif key in out and out[key] == value:
            del out[key]
    return out
