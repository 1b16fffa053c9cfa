"""Handlers of the declarative commands: validate, plan, render, launch, recipes, clusters."""

from __future__ import annotations

import argparse
import json
import sys

from hpc.show import plan_table, table, terminal_width
from hpc.errors import UserError, UserErrors
from hpc.resolve import Resolved, resolve
from hpc.spec.base import load_yaml
from hpc.spec.catalog import available, find


def _this_machine(cluster, for_launch: bool):
    """The local profile is this machine: the cores this process may use (what the frontend's processes scale
    with) and, for a launch, a free port range (several local runs may live side by side)."""
    if not cluster.is_local:
        return cluster
    import os

    update = {"cpus_per_node": len(os.sched_getaffinity(0))}
    if for_launch:
        from hpc.launch.local import free_port_base

        update["port_base"] = free_port_base(cluster.port_base, 64)
    return cluster.model_copy(update=update)


def _resolve(args: argparse.Namespace, for_launch: bool = False) -> Resolved:
    from hpc.engine_args.flags import EngineArgFlags

    r = resolve(args.cluster, args.recipe, args.overrides, adjust_cluster=lambda c: _this_machine(c, for_launch),
                engine_flags=EngineArgFlags(extra=args.extra_engine_args, override=args.override_engine_args),
                trtllm_version=getattr(args, "trtllm_version", None))
    for warning in r.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return r


def _title(r: Resolved) -> str:
    p = r.plan
    return (f"{r.recipe.name} on {r.cluster.name}: {p.job_nodes} node(s), {p.total_gpus} GPU(s) in "
            f"{len(p.workers)} worker(s), backend {r.recipe.backend.value}")


def validate(args: argparse.Namespace) -> int:
    _check_version_flag(args.trtllm_version)
    if args.trtllm_version == "all":
        return _validate_versions(args)
    if args.all or args.recipe is None:
        return _validate_all(args)
    r = _resolve(args)
    print(f"ok: {_title(r)}")
    line = _model_line(r)
    if line:
        print(line)
    return 0


def _validate_all(args: argparse.Namespace) -> int:
    """Every recipe against one cluster: a line each, the first problem of those that fail."""
    if not args.all:
        raise UserError("name a recipe (--recipe NAME) or check them all (--all)", field="--recipe",
                        hint="hpc recipes lists them")
    if args.recipe or args.overrides or args.extra_engine_args or args.override_engine_args:
        raise UserError("checks the recipes as they are", field="--all",
                        hint="drop --recipe, --set and the engine-args flags, or leave --all out")
    from hpc.spec.catalog import load_cluster

    load_cluster(args.cluster)  # a wrong profile is one line, not one per recipe
    rows, failed = [], 0
    for name in available("recipes"):
        try:
            r = resolve(args.cluster, name, adjust_cluster=lambda c: _this_machine(c, False),
                        trtllm_version=args.trtllm_version)
        except UserError as exc:
            failed += 1
            rows.append([name, "FAIL", (exc.errors[0] if isinstance(exc, UserErrors) else exc).render()])
        else:
            rows.append([name, "ok", f"{r.plan.job_nodes} node(s), {r.plan.total_gpus} GPU(s), "
                                     f"{len(r.plan.workers)} worker(s)"])
    print(table(["RECIPE", "", "DETAIL"], rows, width=terminal_width()))
    print(f"{len(rows) - failed} of {len(rows)} recipes validate on {args.cluster}")
    return 2 if failed else 0


def _check_version_flag(value: str | None) -> None:
    from hpc.engine_args import trtllm_versions as tv

    if value is None or value == "all":
        return
    known = [f.version for f in tv.known_versions()]
    try:
        tv.version_key(value)
    except ValueError as exc:
        raise UserError(str(exc), field="--trtllm-version", hint=f"known: {', '.join(known)}, or all") from None
    if tv.facts(value) is None:
        raise UserError(f"TensorRT-LLM {value} is not a version hpc knows", field="--trtllm-version",
                        hint=f"known: {', '.join(known)}, or all")


def version_matrix(cluster: str, recipes: list[str]) -> tuple[list[str], list[list[str]], int]:
    """Each TensorRT-LLM recipe against each known version: 'ok', or the first problem's field and message."""
    from hpc.engine_args import trtllm_versions as tv
    from hpc.spec.catalog import load_recipe

    versions = [f.version for f in tv.known_versions()]
    rows, failed = [], 0
    for name in recipes:
        if load_recipe(name)[0].backend.value != "trtllm":
            continue
        row = [name]
        for version in versions:
            try:
                resolve(cluster, name, adjust_cluster=lambda c: _this_machine(c, False), trtllm_version=version)
            except UserError as exc:
                first = exc.errors[0] if isinstance(exc, UserErrors) else exc
                row.append(f"{first.field}: {first.message}")
                failed += 1
            else:
                row.append("ok")
        rows.append(row)
    return versions, rows, failed


def _validate_versions(args: argparse.Namespace) -> int:
    if args.overrides or args.extra_engine_args or args.override_engine_args:
        raise UserError("checks the recipes as they are", field="--trtllm-version",
                        hint="drop --set and the engine-args flags, or name one version")
    recipes = available("recipes") if args.all or args.recipe is None else [args.recipe]
    versions, rows, failed = version_matrix(args.cluster, recipes)
    print(table(["RECIPE", "TENSORRT-LLM", "VERDICT"], [[row[0], v, cell] for row in rows
                                                         for v, cell in zip(versions, row[1:])],
                width=terminal_width()))
    print(f"{len(rows) * len(versions) - failed} of {len(rows) * len(versions)} recipe x version pairs validate "
          f"on {args.cluster}")
    return 2 if failed else 0


def _model_line(r: Resolved) -> str | None:
    """Whether the layouts were checked against the model's shape here, or are left to the job's preflight."""
    from hpc.model.fit import is_local_path, language_model, read_model_config

    path = r.recipe.model.path
    if r.recipe.model.generate or not is_local_path(path) or r.recipe.modality == "video_diffusion":
        return None  # built by the job, a hub id the engine fetches, or a diffusion pipeline (no LLM layout)
    config = read_model_config(path)
    if config is None:
        return f"model: {path}/config.json is not readable here; the job's preflight checks it on the nodes"
    text = language_model(config)
    shape = ", ".join(f"{text[key]} {what}" for key, what in (
        ("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
        ("num_hidden_layers", "layers")) if isinstance(text.get(key), int))
    return f"model: each role's TP/PP/EP fits {path} ({shape or 'no shape in its config.json'})"


def show_plan(args: argparse.Namespace) -> int:
    r = _resolve(args)
    if args.json:
        print(json.dumps(r.plan.model_dump(mode="json"), indent=2))
    else:
        print(plan_table(r.plan, _title(r)))
    return 0


def render(args: argparse.Namespace) -> int:
    import datetime as dt
    from pathlib import Path

    from hpc.render.sbatch import render_sbatch
    from hpc.rundir import new_run_id, runs_root

    r = _resolve(args)
    now = dt.datetime.now()
    path = runs_root(r.cluster).resolve() / new_run_id(r.recipe.name, now)
    print(render_sbatch(r.manifest(Path(path), path.name, now)), end="")
    return 0


def launch(args: argparse.Namespace) -> int:
    if args.chain is None and args.handover is not None:
        raise UserError("--handover is the handover of a chain of jobs", field="--handover",
                        hint="add --chain N, or leave --handover out")
    r = _resolve(args, for_launch=not args.dry_run)
    return launch_resolved(r, dry_run=args.dry_run, wait=not args.no_wait, smoke=not args.no_smoke,
                           in_allocation=args.in_allocation, chain=args.chain, handover_s=args.handover)[0]


def launch_resolved(r: Resolved, *, dry_run: bool = False, wait: bool = True, smoke: bool = True,
                    in_allocation: bool = False, chain: int | None = None, handover_s: int | None = None):
    """Check what only a launch needs, write the run directory, submit, wait: (exit code, the run)."""
    from hpc import rundir
    from hpc.launch.backends import for_launch
    from hpc.render.sbatch import render_sbatch

    backend = for_launch(r.cluster.is_local, in_allocation)
    if chain is not None:
        from hpc.launch.chain import check_chain

        handover_s = check_chain(r, chain, handover_s, in_allocation)
    if not dry_run:
        backend.check(r)
        _check_secrets(r)
        if r.cluster.container is not None:
            _ensure_runtime_bundle(r, r.cluster.container.python_version)
    if chain is not None:
        chained = rundir.create_chain(r, render_sbatch, chain, handover_s or 0)
        run = chained.link(1)
        for later in chained.links()[1:]:  # nobody follows them from here: each runs its own smoke stage
            later.update_run_info(smoke_via="job" if smoke else "none")
        where = f"chain directory: {chained.path} ({chain} jobs, handover {handover_s} s before each end)"
    else:
        run = rundir.create(r, render_sbatch)
        where = f"run directory: {run.path}"
    print(plan_table(r.plan, _title(r)))
    print(where)
    if dry_run:
        print(f"dry run: nothing submitted. Submit it yourself with: sbatch {run.script_path}")
        return 0, run
    code = backend.submit(run, wait=wait, smoke=smoke)
    if chain is not None and code == 0:
        print(f"one address for the whole chain: hpc endpoint {chained.path.name} --port PORT "
              "(on a host the clients reach; it follows each handover)")
    return code, run


def _check_secrets(r: Resolved) -> None:
    """Secrets by reference must be there when the job starts: check them here, before anything is written."""
    from hpc.spec.cluster import SecretRef

    for name, value in r.cluster.env.items():
        if isinstance(value, SecretRef) and value.resolve() is None:
            where = (f"the environment variable {value.from_env} is not set in this shell" if value.from_env
                     else f"cannot read {value.from_file}")
            raise UserError(f"secret {name}: {where}", file=r.cluster_file, field=f"env.{name}",
                            hint="export it, or fix the path, then launch again")


def _ensure_runtime_bundle(r: Resolved, version: str) -> None:
    """hpc's runtime for the container image, beside the run directories (built once per version)."""
    import time

    from hpc.launch.bundle import ensure_bundle
    from hpc.rundir import bundle_dir, checked_root

    target = bundle_dir(checked_root(r), version)
    t0 = time.monotonic()
    ensure_bundle(target, version)
    if time.monotonic() - t0 > 1:
        print(f"built hpc's runtime for the image's Python {version}: {target} ({time.monotonic() - t0:.0f} s)")


def _describe(kind: str) -> list[list[str]]:
    rows = []
    for name in available(kind):
        try:
            data = load_yaml(find(kind, name))
        except UserError:
            data = {}
        rows.append([name, str(data.get("description", ""))])
    return rows


def list_recipes(args: argparse.Namespace) -> int:
    print(table(["RECIPE", "DESCRIPTION"], _describe("recipes"), width=terminal_width()))
    return 0


def list_clusters(args: argparse.Namespace) -> int:
    print(table(["CLUSTER", "DESCRIPTION"], _describe("clusters"), width=terminal_width()))
    return 0
