"""`hpc profile`: size a recipe for an SLA in one allocation (hpc/profile/)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hpc.cli.bench_command import positive_ints
from hpc.errors import UserError


def add_parser(sub: argparse._SubParsersAction, add_target) -> None:
    p = sub.add_parser("profile", help="sweep TP sizes in one allocation, pick the deployment that meets an SLA, "
                                       "write it as a recipe")
    add_target(p)
    p.add_argument("--isl", type=int, required=True, help="input tokens of the target workload")
    p.add_argument("--osl", type=int, required=True, help="output tokens of the target workload")
    p.add_argument("--ttft", type=float, required=True, metavar="MS", help="time-to-first-token target")
    p.add_argument("--itl", type=float, required=True, metavar="MS", help="inter-token-latency target")
    p.add_argument("--tp", type=positive_ints, default=[1], help="TP sizes to profile, e.g. 1,2,4,8 (default: 1)")
    p.add_argument("--max-gpus", type=int, help="GPUs the profile may hold at once (default: the cluster's)")
    p.add_argument("--requests", type=int, default=8, help="requests per point (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=64, help="highest decode concurrency (default: 64)")
    p.add_argument("--out", type=Path, help="output directory (default: RUNS/profile-<recipe>-<time>); "
                                            "an interrupted profile there is resumed")
    p.add_argument("--form", choices=["disagg", "agg"],
                   help="disagg (default for a disaggregated recipe): engines in the roles they serve in; agg: "
                        "each role converted to its aggregated profiling form (Dynamo's profiler)")
    p.add_argument("--dry-run", action="store_true", help="print the sweep plan and stop")
    p.set_defaults(func=profile)


def profile(args: argparse.Namespace) -> int:
    from hpc.cli.commands import _this_machine, launch_resolved, plan_table
    from hpc.profile.choose import choose
    from hpc.profile.plan import default_form, engines, fed_by, points, profile_recipe, requests_at
    from hpc.profile.spec import ProfileRequest, check_request, gpus_needed
    from hpc.resolve import resolve, resolve_specs
    from hpc.rundir import runs_root

    resolved = resolve(args.cluster, args.recipe, args.overrides)
    recipe = resolved.recipe
    req = ProfileRequest(isl=args.isl, osl=args.osl, ttft_ms=args.ttft, itl_ms=args.itl, tps=args.tp,
                         max_gpus=args.max_gpus, requests=args.requests, max_concurrency=args.max_concurrency)
    check_request(req, resolved)
    cluster = _this_machine(resolved.cluster, for_launch=not args.dry_run)
    if args.form == "disagg" and not recipe.disaggregated:
        raise UserError("--form disagg needs a disaggregated recipe", file=resolved.recipe_file, field="roles",
                        hint="leave --form out for an aggregated recipe")
    form = args.form or default_form(recipe)
    prof = resolve_specs(cluster, Path(resolved.cluster_file), profile_recipe(recipe, req.tps, form),
                         Path(resolved.recipe_file))
    todo = points(recipe, req, prof.engine_args, form)
    out = (args.out or runs_root(cluster) / f"profile-{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    print(f"profile of {recipe.name} on {cluster.name} ({form} form): isl {req.isl}, osl {req.osl}, "
          f"TTFT <= {req.ttft_ms:g} ms, "
          f"ITL <= {req.itl_ms:g} ms; TP {','.join(map(str, req.tps))}; {gpus_needed(req.tps, recipe.disaggregated)} "
          f"GPU(s) in one allocation")
    for e in engines(recipe, req.tps, form):
        n = [p for p in todo if p.pool == e.pool]
        print(f"  engine {e.pool}: TP {e.tp}, {len(n)} points ({sum(requests_at(p, req) for p in n)} requests)")
    if args.dry_run:
        print(plan_table(prof.plan, f"{prof.recipe.name} on {cluster.name}: {prof.plan.job_nodes} node(s), "
                                    f"{prof.plan.total_gpus} GPU(s)"))
        print(f"points: {len(todo)}; estimated {_estimate(todo, req) / 60:.1f} min of measuring after the engines "
              f"are ready (at 50 ms per output token and 100 ms per 1,000 input tokens; real engines differ)")
        print(f"would write: {out}/profile.json, plots, recipe.yaml (dry run: nothing started or written)")
        return 0
    from hpc.profile.sweep import load_results, run_points

    out.mkdir(parents=True, exist_ok=True)
    results = load_results(out, req, recipe.name, cluster.name)
    before = sum(p.key in results["points"] for p in todo)
    if before == len(todo):
        print(f"every point is measured already ({out / 'profile.json'}): nothing to launch")
        return _conclude(recipe, resolved, req, results, out)
    if before:
        print(f"resuming: {before} of {len(todo)} points measured before")
    code, run = launch_resolved(prof, smoke=False)
    if code != 0:
        raise UserError(f"the profile's engines did not come up (run {run.path.name})",
                        hint=f"hpc status {run.path.name}; hpc logs {run.path.name}")
    try:
        url = run.frontend_url()
        if url is None:
            raise UserError(f"the profile's frontend said nowhere it listens (run {run.path.name})",
                            hint=f"hpc logs {run.path.name}")
        results["run"] = run.path.name
        prefill = [p for p in todo if p.phase == "prefill"]
        run_points(prefill, req, url, recipe.model.served_name, out, results, total=len(todo))
        decode = [p for p in todo if p.phase == "decode"]
        if form == "disagg":  # decode fed by the prefill size the choice picks, as the emitted recipe serves
            chosen = choose(list(results["points"].values()), req)["prefill"]["chosen"]
            if chosen is not None:
                print(f"decode levels fed by prefill TP {chosen['tp']} (the prefill choice)")
                decode = [fed_by(p, recipe, req, chosen["tp"]) for p in decode]
        run_points(decode, req, url, recipe.model.served_name, out, results, total=len(todo),
                   done_before=len(prefill))
    finally:
        _stop(run)
    return _conclude(recipe, resolved, req, results, out)


def _estimate(points, req) -> float:
    from hpc.profile.plan import requests_at

    total = 0.0
    for p in points:
        n = requests_at(p, req)
        total += (n + 1) * (0.1 * p.isl / 1000 + 0.05 * p.osl) / (p.concurrency if p.phase == "decode" else 1)
    return total


def _stop(run) -> None:
    from hpc.cli.runtime_commands import cancel

    cancel(argparse.Namespace(run=str(run.path), grace=10.0, remove=False))


def _conclude(recipe, resolved, req, results: dict[str, Any], out: Path) -> int:
    from hpc.profile import choose as pick
    from hpc.profile.plan import isl_points
    from hpc.profile.report import choice_table, plots, points_table
    from hpc.profile.sweep import save

    measured = list(results["points"].values())
    choice = pick.choose(measured, req)
    results["choice"] = choice
    print(points_table(measured))
    print(choice_table(choice, req))
    written = [out / "profile.json"]
    try:
        written += plots(measured, choice, req, out)
    except ImportError:  # a light launcher install: the figures are in the JSON and the table
        print("plots skipped: matplotlib is not installed (pip install 'hpc[serve]')")
    emitted = pick.emitted_recipe(recipe, choice, req)
    recipe_path = _write_recipe(emitted, resolved, out / "recipe.yaml")
    written.append(recipe_path)
    results["emitted"] = {"recipe": str(recipe_path)}
    grid = pick.router_grid(measured, req, isl_points(req, recipe.limits.max_input_tokens)) \
        if recipe.disaggregated else pick.agg_router_grid(measured, req)
    if grid is not None:  # different sizes win different regions: pools of them behind that grid
        (out / "global_router.json").write_text(json.dumps(grid, indent=2) + "\n")
        pooled_path = _write_recipe(pick.pooled_recipe(emitted, grid, "global_router.json"), resolved,
                                    out / "recipe-pools.yaml")
        written += [out / "global_router.json", pooled_path]
        results["emitted"]["pools"] = str(pooled_path)
    save(out, results)
    print("wrote: " + ", ".join(str(p) for p in written))
    met = all(choice[k]["chosen"] is not None and choice[k]["chosen"]["meets"] for k in ("prefill", "decode"))
    print(f"next: hpc launch -c {resolved.cluster.name} -r {recipe_path}; then hpc bench RUN")
    if not met:
        print("SLA NOT MET by any profiled size: the recipe written is the closest; profile larger TP sizes")
    return 0


def _write_recipe(recipe, resolved, path: Path) -> Path:
    """A recipe the profile made, its engine-config paths made absolute (it is written away from the recipe they
    were relative to), checked as `hpc validate` would (relative to where it is written), then written."""
    import yaml

    from hpc.resolve import resolve_specs

    recipe = _absolute_configs(recipe, Path(resolved.recipe_file))
    resolve_specs(resolved.cluster, Path(resolved.cluster_file), recipe, path)
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json", exclude_defaults=True), sort_keys=False))
    return path


def _absolute_configs(recipe, recipe_path: Path):
    """Engine-config paths as absolute ones: the recipe is written elsewhere than the one it came from."""
    from hpc.spec.catalog import resolve_config_path

    def fix(spec):
        update = {}
        if spec.engine_config:
            update["engine_config"] = str(resolve_config_path(spec.engine_config, recipe_path))
        if spec.pools:
            update["pools"] = [fix(p) for p in spec.pools]
        return spec.model_copy(update=update)

    roles = {name.value: fix(spec) for name, spec in recipe.roles.items()}
    return recipe.model_copy(update={"roles": recipe.roles.model_copy(update=roles)})
