"""Load a cluster + recipe, merge engine args, validate everything, plan: the resolved manifest.

Nothing is written here; every mistake found is reported before anything is submitted.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from hpc.checks.chat_images import image_route_problem
from hpc.model.fit import encode_problem, fit_problems, is_local_path, read_model_config
from hpc.model.generated import generated_config
from hpc.engine_args.flags import EngineArgFlags, apply_engine_flags
from hpc.engine_args.precedence import (forced_values, merge_engine_args, overridden, prune_for_autodeploy,
                                        recipe_defaults)
from hpc.engine_args.schema import BASE_TABLE, check_engine_config
from hpc.engine_args.version_rules import VersionCheck, check_version
from hpc.engine_args.scheduling import ChunkingPolicy, max_num_tokens, tokens_per_block
from hpc.errors import UserError, UserErrors
from hpc.plan.placement import PORTS_PER_WORKER, WORKER_PORTS_START, Plan, plan
from hpc.spec.base import load_yaml
from hpc.spec.catalog import load_cluster, load_recipe, resolve_config_path
from hpc.spec.cluster import ClusterProfile, time_to_minutes
from hpc.spec.diffusion import TORCH_PARALLEL, check_sizes, model_facts
from hpc.spec.global_router import load_global_router, parse_global_router
from hpc.spec.recipe import Backend, Recipe, RoleName, RoleSpec, WorkerGroup
from hpc.manifest import ChainLink, Manifest


# an engine's layout key -> the recipe role's field that sets it (the two are checked to agree)
RECIPE_LAYOUT = {"tensor_parallel_size": "tensor_parallel_size", "pipeline_parallel_size": "pipeline_parallel_size",
                 "moe_expert_parallel_size": "expert_parallel_size"}


class Resolved(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    cluster: ClusterProfile
    cluster_file: str
    recipe: Recipe
    recipe_file: str
    plan: Plan
    engine_args: dict[str, dict[str, Any]]
    engine_config_files: dict[str, str | None]
    trtllm_versions: list[str] = []
    warnings: list[str] = []

    def manifest(self, run_dir: Path, run_id: str, created: _dt.datetime, chain: ChainLink | None = None) -> Manifest:
        return Manifest(run_id=run_id, run_dir=str(run_dir), created=created.isoformat(timespec="seconds"),
                        cluster=self.cluster, recipe=self.recipe, plan=self.plan,
                        engine_args=self.engine_args, engine_config_files=self.engine_config_files,
                        trtllm_versions=self.trtllm_versions, chain=chain)


def resolve(cluster_name: str, recipe_name: str, overrides: list[str] | None = None,
            adjust_cluster=None, engine_flags: EngineArgFlags | None = None,
            trtllm_version: str | None = None) -> Resolved:
    cluster, cluster_path = load_cluster(cluster_name)
    if adjust_cluster is not None:
        cluster = adjust_cluster(cluster)
    recipe, recipe_path = load_recipe(recipe_name, overrides)
    return resolve_specs(cluster, cluster_path, recipe, recipe_path, engine_flags, trtllm_version)


def resolve_specs(cluster: ClusterProfile, cluster_path: Path, recipe: Recipe, recipe_path: Path,
                  engine_flags: EngineArgFlags | None = None, trtllm_version: str | None = None) -> Resolved:
    """`trtllm_version`: check against that TensorRT-LLM instead of the profile's (validate --trtllm-version)."""
    errors: list[UserError] = []
    warnings: list[str] = []
    rfile = str(recipe_path)
    flag_sources: dict[str, str] = {}
    if engine_flags:
        recipe, flag_sources = apply_engine_flags(recipe, engine_flags)
    recipe, router_errors = _load_global_router(recipe, recipe_path, rfile)
    errors += router_errors
    trtllm = recipe.backend is Backend.TRTLLM
    # the model's shape, where this machine can read it (a login node that mounts the models' filesystem)
    model_config = None if recipe.model.generate else read_model_config(recipe.model.path)
    shape = model_config or generated_config(recipe.model.generate)  # a generated model's is known before it is
    table_name, expected = BASE_TABLE, []
    if trtllm:
        version = _trtllm_version(cluster, str(cluster_path), recipe, model_config, trtllm_version)
        errors += version.errors
        warnings += version.warnings
        table_name, expected = version.table_name, list(version.target.versions)
    engine_args: dict[str, dict[str, Any]] = {}
    config_files: dict[str, str | None] = {}
    for group in recipe.roles.groups():
        merged, efile, problems = _group_engine_args(recipe, recipe_path, group, flag_sources, table_name, shape,
                                                     model_config, warnings)
        errors += problems
        if merged is not None:
            engine_args[group.key] = merged
            config_files[group.key] = efile
    errors += _check_disagg_pair(recipe, engine_args, config_files, rfile)
    errors += _check_model_use(cluster, recipe, model_config, rfile)
    errors += _check_time(cluster, recipe, str(cluster_path), rfile)
    too_big = _check_size(cluster, recipe, rfile)
    if too_big:  # before planning: a billion workers must not be built to find out they do not fit
        raise too_big
    placement = None
    try:
        placement = plan(cluster, recipe)
    except UserError as exc:
        errors.append(UserError(exc.message, file=rfile, field=exc.field, hint=exc.hint))
    if placement is not None:
        errors += _check_fit(cluster, recipe, placement, str(cluster_path), rfile)
    if errors:
        raise errors[0] if len(errors) == 1 else UserErrors(errors)
    assert placement is not None
    return Resolved(cluster=cluster, cluster_file=str(cluster_path), recipe=recipe, recipe_file=rfile,
                    plan=placement, engine_args=engine_args, engine_config_files=config_files,
                    trtllm_versions=expected, warnings=warnings)


def _group_engine_args(recipe: Recipe, recipe_path: Path, group: Any, flag_sources: dict[str, str], table_name: str,
                       shape: dict[str, Any] | None, model_config: dict[str, Any] | None,
                       warnings: list[str]) -> tuple[dict[str, Any] | None, str | None, list[UserError]]:
    """One role's (or pool's) merged engine arguments, its engine config file, and what is wrong with them (None
    for the arguments where its engine config cannot be read)."""
    rfile = str(recipe_path)
    trtllm = recipe.backend is Backend.TRTLLM
    errors: list[UserError] = []
    role_name, role = group.role, group.spec
    field = _group_field(recipe, group)
    extra: dict[str, Any] = {}
    efile = None
    if role.engine_config:
        path = resolve_config_path(role.engine_config, recipe_path)
        efile = str(path)
        if not path.is_file():
            return None, efile, [UserError(f"engine config not found: {path}", file=rfile,
                                           field=f"{field}.engine_config",
                                           hint="fix the path (relative to the recipe or the project)")]
        try:
            extra = load_yaml(path)
        except UserError as exc:
            return None, efile, [exc]
        errors += check_engine_config(extra, file=efile, table_name=table_name)
    if role.override_engine_args:
        source = (flag_sources.get(role_name.value) if group.pool is None else None) or \
            f"{rfile}: {field}.override_engine_args"
        errors += check_engine_config(role.override_engine_args, file=source, table_name=table_name)
    unforced = merge_engine_args(recipe_defaults(recipe, role, trtllm=trtllm), extra, role.override_engine_args, {})
    backend = str(unforced.get("backend", "pytorch"))
    forced = forced_values(publish_kv_events=recipe.runtime.publish_kv_events and trtllm, backend=backend)
    warnings += [f"{group.key}: the runtime sets {change} (KV events and metrics are published; "
                 "runtime.publish_kv_events: false turns that off)" for change in overridden(unforced, forced)]
    merged = merge_engine_args(unforced, None, None, forced)
    errors += _check_role(recipe, role_name, role, field, merged, rfile, efile)
    if shape is not None and role_name is not RoleName.ENCODE:  # the encoder's heads are the vision's
        source = f"{recipe.model.path}/config.json" if model_config else f"model.generate {recipe.model.generate}"
        errors += [UserError(f"{problem} ({source})", file=rfile, field=f"{field}.{RECIPE_LAYOUT[key]}", hint=fix)
                   for key, problem, fix in fit_problems(shape, merged, recipe.backend.value)]
    if trtllm and backend == "_autodeploy":
        merged = prune_for_autodeploy(merged, warn=lambda w, r=group.key: warnings.append(f"{r}: {w}"))
    return merged, efile, errors


def _check_model_use(cluster: ClusterProfile, recipe: Recipe, model_config: dict[str, Any] | None,
                     rfile: str) -> list[UserError]:
    """What the recipe asks of its model and engine that they cannot do."""
    errors: list[UserError] = []
    if recipe.model.canned_completion and recipe.backend is not Backend.TORCH:
        errors.append(UserError("a test knob of the torch engine only", file=rfile,
                                field="model.canned_completion", hint="remove it, or use backend: torch"))
    if recipe.runtime.engine_process == "own" and (recipe.backend is not Backend.TORCH or recipe.modality != "text"):
        errors.append(UserError(
            f"a process of its own is for the torch engine serving text (this recipe: {recipe.backend.value}, "
            f"{recipe.modality})", file=rfile, field="runtime.engine_process", hint="remove it, or set auto or worker"))
    errors += _check_video(cluster, recipe, rfile)
    if recipe.backend is Backend.TORCH and recipe.modality != "video_diffusion" and not recipe.model.generate \
            and not is_local_path(recipe.model.path):
        errors.append(UserError(
            f"{recipe.model.path!r} is a hub id; the torch reference engine reads its weights from a directory",
            file=rfile, field="model.path", hint="download it (huggingface-cli download ID --local-dir DIR) and give "
                                                 "DIR, or use backend: trtllm, which fetches hub ids itself"))
    images = image_route_problem(Path(recipe.model.tokenizer or recipe.model.path).expanduser(), model_config,
                                 recipe.model.chat_template) if model_config is not None and recipe.model.multimodal \
        else None
    if images:
        errors.append(UserError(images, file=rfile, field="model.chat_template",
                                hint="give a template that loops over content parts (model.chat_template), as the "
                                     "model's processor-side chat_template.json does"))
    encode_split = encode_problem(model_config, recipe.backend.value) \
        if model_config is not None and recipe.roles.encode is not None else None
    if encode_split:
        errors.append(UserError(encode_split[0], file=rfile, field="roles.encode", hint=encode_split[1]))
    if recipe.roles.encode is not None and not recipe.model.multimodal:
        errors.append(UserError("an encode role needs a multimodal model", file=rfile, field="roles.encode",
                                hint="set model.multimodal: true or remove roles.encode"))
    return errors


def _trtllm_version(cluster: ClusterProfile, cluster_file: str, recipe: Recipe, model_config: dict[str, Any] | None,
                    asked: str | None) -> VersionCheck:
    image = cluster.container.image if cluster.container else None
    return check_version(cluster.trtllm_version, image, asked, cluster_file=cluster_file,
                         encode_role=recipe.roles.encode is not None, model_config=model_config)


def _group_field(recipe: Recipe, group: WorkerGroup) -> str:
    """Where a worker group sits in the recipe: roles.prefill, or roles.prefill.pools[1] (by the pool's name)."""
    if group.pool is None:
        return f"roles.{group.role.value}"
    return f"roles.{group.role.value}.pools[{recipe.roles.pools(group.role).index(group.pool)}]"


def _check_role(recipe: Recipe, role_name: RoleName, role: RoleSpec, field: str, merged: dict[str, Any],
                rfile: str, efile: str | None) -> list[UserError]:
    errors = []
    tp = merged.get("tensor_parallel_size", 1)
    pp = merged.get("pipeline_parallel_size", 1)
    ep = merged.get("moe_expert_parallel_size") or 1
    where = efile or rfile
    if isinstance(tp, int) and isinstance(pp, int) and tp * pp != role.gpus_per_worker:
        errors.append(UserError(
            f"engine TP x PP = {tp} x {pp} = {tp * pp}, but the recipe gives each {role_name.value} worker "
            f"{role.gpus_per_worker} GPUs ({field}.tensor_parallel_size x pipeline_parallel_size)",
            file=where, field="tensor_parallel_size", hint="make the engine config and the recipe agree"))
    if isinstance(tp, int) and isinstance(pp, int) and isinstance(ep, int) and (tp * pp) % ep:
        errors.append(UserError(f"expert-parallel size {ep} does not divide TP x PP = {tp * pp}",
                                file=where, field="moe_expert_parallel_size",
                                hint="use an expert-parallel size that divides TP x PP"))
    if isinstance(ep, int) and ep != role.expert_parallel_size:
        errors.append(UserError(
            f"engine expert-parallel size {ep} but the recipe plans {role.expert_parallel_size} "
            f"({field}.expert_parallel_size)", file=where, field="moe_expert_parallel_size",
            hint="make the engine config and the recipe agree"))
    if recipe.backend is Backend.TORCH:  # what the reference engine cannot run is refused, not ignored
        ep_size = role.expert_parallel_size
        if ep_size != 1 and (ep_size != role.tensor_parallel_size or role.pipeline_parallel_size != 1):
            errors.append(UserError(
                f"the torch reference engine runs expert parallelism equal to tensor parallelism without "
                f"pipeline stages (EP {ep_size}, TP {role.tensor_parallel_size}, PP "
                f"{role.pipeline_parallel_size})", file=rfile, field=f"{field}.expert_parallel_size",
                hint=f"set {field}.expert_parallel_size to 1 or to tensor_parallel_size, or use backend: trtllm"))
        elif ep_size != 1 and recipe.model.generate not in (None, "tiny-moe"):
            errors.append(UserError(
                f"expert parallelism needs a mixture-of-experts model; model.generate {recipe.model.generate} "
                f"builds a dense one", file=rfile, field="model.generate",
                hint="use model.generate: tiny-moe, or set expert_parallel_size: 1"))
        if isinstance(pp, int) and isinstance(tp, int) and pp > 1 and tp > 1:
            errors.append(UserError(
                f"the torch reference engine runs tensor or pipeline parallelism, not both (TP {tp} x PP {pp})",
                file=rfile, field=f"{field}.pipeline_parallel_size",
                hint="set tensor_parallel_size or pipeline_parallel_size to 1, or use backend: trtllm"))
        if merged.get("enable_attention_dp"):
            errors.append(UserError("the torch reference engine has no attention-DP", file=where,
                                    field="enable_attention_dp", hint="remove it, or use backend: trtllm"))
        policy = (merged.get("scheduler_config") or {}).get("context_chunking_policy")
        if policy is not None and policy not in {p.value for p in ChunkingPolicy}:
            errors.append(UserError(f"the torch reference engine chunks prompts "
                                    f"{' or '.join(p.value for p in ChunkingPolicy)}, not {policy}", file=where,
                                    field="scheduler_config.context_chunking_policy",
                                    hint="use one of those, or backend: trtllm"))
        step, unit = merged.get("max_num_tokens"), _tokens_per_block(merged)
        if merged.get("enable_chunked_prefill") and isinstance(step, int) and unit and step < unit:
            # the engine refuses it at start (TorchEngine): said here, before anything is submitted
            errors.append(UserError(
                f"max_num_tokens {step} is below one chunk (kv_cache_config.tokens_per_block {unit}): with "
                f"enable_chunked_prefill no long prompt could start", file=where, field="max_num_tokens",
                hint=f"raise max_num_tokens to at least {unit}"))
    if merged.get("enable_attention_dp") and tp == 1:
        errors.append(UserError("attention-DP needs tensor_parallel_size > 1", file=where,
                                field="enable_attention_dp", hint="disable it or raise TP"))
    budget, longest = merged.get("max_num_tokens"), recipe.limits.max_input_tokens
    budget = max_num_tokens(merged) if isinstance(budget, int) or budget is None else None
    if role_name in (RoleName.AGG, RoleName.PREFILL) and not merged.get("enable_chunked_prefill") and \
            budget is not None and budget < longest:
        # both engines refuse such a prompt at request time (TensorRT-LLM's LLM._check_arguments): found here,
        # not by the first user with a long prompt
        errors.append(UserError(
            f"max_num_tokens {budget} is below the longest prompt the recipe accepts (limits.max_input_tokens "
            f"{longest}) and enable_chunked_prefill is off: longer prompts would be refused by the engine",
            file=where, field="max_num_tokens",
            hint=f"set enable_chunked_prefill: true, raise max_num_tokens to at least {longest}, or lower "
                 f"limits.max_input_tokens"))
    return errors


def _tokens_per_block(merged: dict[str, Any]) -> int | None:
    """The KV block, or None when its setting has the wrong type (the schema check reports that)."""
    try:
        return tokens_per_block(merged)
    except (AttributeError, TypeError, ValueError):
        return None


def _check_disagg_pair(recipe: Recipe, args: dict[str, dict[str, Any]], files: dict[str, str | None],
                       rfile: str) -> list[UserError]:
    if not recipe.disaggregated:
        return []
    groups = {role: [g.key for g in recipe.roles.groups() if g.role is role and g.key in args]
              for role in (RoleName.PREFILL, RoleName.DECODE)}
    errors = []
    dtype = {key: (args[key].get("kv_cache_config") or {}).get("dtype", "auto") for keys in groups.values()
             for key in keys}
    for p in groups[RoleName.PREFILL]:  # every prefill may hand its KV to every decode
        for d in groups[RoleName.DECODE]:
            if dtype[p] != dtype[d]:
                errors.append(UserError(
                    f"{p} uses KV-cache dtype {dtype[p]!r} but {d} uses {dtype[d]!r}", file=files[d] or rfile,
                    field="kv_cache_config.dtype",
                    hint="prefill and decode must share one KV-cache dtype to transfer the cache"))
                break
    if recipe.backend is Backend.TORCH:
        for group in recipe.roles.groups():
            spec = group.spec
            if group.role in (RoleName.PREFILL, RoleName.DECODE) and spec.pipeline_parallel_size > 1:
                errors.append(UserError(
                    f"the torch reference engine hands the KV cache over between tensor-parallel workers, not "
                    f"pipeline stages (PP {spec.pipeline_parallel_size})",
                    file=rfile, field=f"{_group_field(recipe, group)}.pipeline_parallel_size",
                    hint="set pipeline_parallel_size to 1 for prefill and decode, serve it aggregated, or use "
                         "backend: trtllm"))
    if recipe.backend is Backend.TRTLLM:
        if recipe.runtime.kv_transport != "auto":
            errors.append(UserError(
                f"runtime.kv_transport {recipe.runtime.kv_transport!r} is the torch engine's; TensorRT-LLM moves "
                f"the KV cache through its cache transceiver", file=rfile, field="runtime.kv_transport",
                hint="remove it and set cache_transceiver_config.backend (UCX or NIXL) in the engine configs"))
        for key in groups[RoleName.PREFILL] + groups[RoleName.DECODE]:
            ctc = args[key].get("cache_transceiver_config") or {}
            where = files[key] or rfile
            if not ctc.get("backend"):
                errors.append(UserError("disaggregated serving needs a cache transceiver", file=where,
                                        field="cache_transceiver_config.backend", hint="set e.g. backend: UCX"))
            limit = ctc.get("max_tokens_in_buffer")
            if limit is not None and limit < recipe.limits.max_input_tokens:
                errors.append(UserError(
                    f"max_tokens_in_buffer {limit} is below the longest input the recipe allows "
                    f"({recipe.limits.max_input_tokens}); KV transfers of longer prompts deadlock",
                    file=where, field="cache_transceiver_config.max_tokens_in_buffer",
                    hint=f"raise it to at least {recipe.limits.max_input_tokens} or lower limits.max_input_tokens"))
    return errors


def _load_global_router(recipe: Recipe, recipe_path: Path, rfile: str) -> tuple[Recipe, list[UserError]]:
    """The recipe with its global-router config inline (the manifest carries it to the frontend), checked against
    the recipe's pools; or what is wrong, one line each."""
    source = recipe.frontend.global_router
    pooled = [name for name, spec in recipe.roles.items() if spec.pools]
    if source is None:
        if pooled:
            return recipe, [UserError(f"roles.{pooled[0].value} has pools but nothing chooses among them",
                                      file=rfile, field="frontend.global_router",
                                      hint="add a global-router config (Dynamo's global_router JSON) naming them")]
        return recipe, []
    try:
        if isinstance(source, str):
            path = resolve_config_path(source, recipe_path)
            config = load_global_router(path)
            where = str(path)
        else:
            where = f"{rfile}: frontend.global_router"
            config = parse_global_router(source, where)
    except UserError as exc:
        return recipe, [exc]
    errors = []
    for kind in config.kinds():
        names, have = config.pools(kind), recipe.roles.pools(kind)
        field = f"{kind}_pool_dynamo_namespaces"
        if getattr(recipe.roles, kind) is None:
            errors.append(UserError(f"mode {config.mode} routes {kind} requests but the recipe has no {kind} role",
                                    file=where, field="mode", hint="match the config's mode to the recipe's roles"))
        elif set(names) - set(have):
            errors.append(UserError(
                f"pool {sorted(set(names) - set(have))[0]!r} is not among the recipe's {kind} pools "
                f"({', '.join(have) or 'none'})", file=where, field=field,
                hint=f"name exactly the pools under roles.{kind}.pools"))
        elif set(have) - set(names):
            errors.append(UserError(
                f"the recipe's {kind} pool {sorted(set(have) - set(names))[0]!r} is missing here, so no request "
                f"would reach it", file=where, field=field, hint=f"list every pool under roles.{kind}.pools"))
    if errors:
        return recipe, errors
    inline = config.model_dump(mode="json", exclude_none=True)
    return recipe.model_copy(update={"frontend": recipe.frontend.model_copy(update={"global_router": inline})}), []


def _check_video(cluster: ClusterProfile, recipe: Recipe, rfile: str) -> list[UserError]:
    """Video diffusion (seed 004): the flags against the workers, the model and the engine; one line each."""
    d = recipe.diffusion
    if d is None:
        return []
    errors = []
    role = recipe.roles.agg
    sizes = " x ".join(f"{f.removeprefix('dit_').removesuffix('_size')} {getattr(d, f)}"
                       for f in ("dit_dp_size", "dit_tp_size", "dit_ulysses_size", "dit_ring_size", "dit_cfg_size"))
    if role is not None and d.ranks != role.gpus_per_worker:
        errors.append(UserError(
            f"the DiT parallel sizes ({sizes}) make {d.ranks} ranks, but each worker has {role.gpus_per_worker} "
            f"GPU(s) (roles.agg.tensor_parallel_size x pipeline_parallel_size)", file=rfile, field="diffusion",
            hint=f"set roles.agg.tensor_parallel_size: {d.ranks}, or change the dit_* sizes"))
    facts = model_facts(recipe.model.generate)
    problem = check_sizes(facts, d.default_height, d.default_width, d.default_num_frames)
    if problem:
        field = "diffusion.default_num_frames" if "frames" in problem else "diffusion.default_height"
        errors.append(UserError(f"default size: {problem}", file=rfile, field=field,
                                hint="fix default_height / default_width / default_num_frames"))
    if recipe.backend is Backend.TORCH:
        others = [f for f in ("dit_dp_size", "dit_tp_size", "dit_ring_size", "dit_fsdp_size") if getattr(d, f) > 1]
        if others:
            errors.append(UserError(f"the torch reference engine runs {' and '.join(TORCH_PARALLEL)}, not "
                                    f"{others[0]}", file=rfile, field=f"diffusion.{others[0]}",
                                    hint="set it to 1, or use backend: trtllm"))
        for flag in ("attn_type", "linear_type"):
            if getattr(d, flag) != "default":
                errors.append(UserError(f"the torch reference engine has only the default {flag}", file=rfile,
                                        field=f"diffusion.{flag}", hint="set it to default, or use backend: trtllm"))
        if d.enable_async_cpu_offload:
            errors.append(UserError("the torch reference engine does not offload to the CPU", file=rfile,
                                    field="diffusion.enable_async_cpu_offload", hint="remove it"))
    if d.output_dir is not None:
        out = Path(d.output_dir).expanduser()
        if not out.is_absolute():
            errors.append(UserError(f"output_dir {d.output_dir!r} is relative; the workers run elsewhere",
                                    file=rfile, field="diffusion.output_dir", hint="give an absolute path on the "
                                                                                    "cluster's shared filesystem"))
        else:
            existing = next(p for p in (out, *out.parents) if p.exists())
            if not os.access(existing, os.W_OK):
                errors.append(UserError(f"output_dir {out} is not writable ({existing} is not)", file=rfile,
                                        field="diffusion.output_dir", hint="pick a directory you can write"))
    return errors


def _check_time(cluster: ClusterProfile, recipe: Recipe, cfile: str, rfile: str) -> list[UserError]:
    limit = recipe.time_limit or cluster.time_limit
    try:
        wanted = time_to_minutes(limit)
    except ValueError as exc:
        return [UserError(str(exc), file=rfile, field="time_limit")]
    if cluster.max_time_limit and wanted > time_to_minutes(cluster.max_time_limit):
        return [UserError(f"time limit {limit} exceeds the partition's "
                          f"maximum {cluster.max_time_limit}", file=rfile if recipe.time_limit else cfile,
                          field="time_limit", hint="shorten it")]
    if recipe.drain_before_end_s and recipe.drain_before_end_s >= wanted * 60:
        return [UserError(f"{recipe.drain_before_end_s} s is not less than the job's time limit "
                          f"({limit}): the workers would drain as they start",
                          file=rfile, field="drain_before_end_s",
                          hint="lower it, lengthen time_limit, or set 0 for no drain before the end")]
    return []


MAX_LOCAL_PROCESSES = 64


def _check_size(cluster: ClusterProfile, recipe: Recipe, rfile: str) -> UserError | None:
    """The recipe's total size against what the cluster (or this machine) can hold, from the numbers alone."""
    ranks = sum(g.spec.count * g.spec.gpus_per_worker for g in recipe.roles.groups())
    if cluster.is_local:
        if ranks > MAX_LOCAL_PROCESSES:
            return UserError(f"the recipe needs {ranks} worker processes; one machine runs at most "
                             f"{MAX_LOCAL_PROCESSES}", file=rfile, field="roles",
                             hint="use fewer or smaller workers, or a Slurm cluster profile")
        return None
    capacity = cluster.nodes_available * max(cluster.gpus_per_node, 1)
    if ranks > capacity:
        return UserError(f"the recipe needs {ranks} GPUs (count x TP x PP over its roles) but cluster "
                         f"'{cluster.name}' has {capacity} ({cluster.nodes_available} nodes x "
                         f"{cluster.gpus_per_node})", file=rfile, field="roles",
                         hint="use fewer or smaller workers, or another cluster")
    return None


def _check_fit(cluster: ClusterProfile, recipe: Recipe, placement: Plan, cfile: str,
               rfile: str) -> list[UserError]:
    errors = []
    if placement.job_nodes > cluster.nodes_available:
        errors.append(UserError(
            f"the job needs {placement.job_nodes} nodes but cluster '{cluster.name}' has {cluster.nodes_available}",
            file=rfile, field="roles", hint="use fewer or smaller workers, or another cluster"))
    if cluster.is_local and recipe.backend is Backend.TRTLLM and placement.total_gpus > cluster.gpus_per_node:
        errors.append(UserError(
            f"the recipe needs {placement.total_gpus} GPUs but this machine has {cluster.gpus_per_node}",
            file=rfile, field="roles", hint="run it on a Slurm cluster profile"))
    if not cluster.is_local and recipe.backend is not Backend.MOCK:
        for w in placement.workers:
            if w.gpus_per_node > cluster.gpus_per_node:
                errors.append(UserError(
                    f"{w.name} needs {w.gpus_per_node} GPUs on a node but nodes have {cluster.gpus_per_node}",
                    file=rfile, field=f"roles.{w.role.value}", hint="lower TP x PP"))
                break
    base = cluster.port_base
    top = base + WORKER_PORTS_START + PORTS_PER_WORKER * len(placement.workers)
    if base <= recipe.frontend.port < top:
        errors.append(UserError(
            f"frontend port {recipe.frontend.port} clashes with the job's ports {base}-{top - 1} "
            f"(cluster port_base {base})", file=rfile, field="frontend.port",
            hint=f"pick a port outside {base}-{top - 1}"))
    if top > 65535:
        errors.append(UserError(f"ports run past 65535 from port_base {base}", file=cfile, field="port_base",
                                hint="lower port_base"))
    return errors
