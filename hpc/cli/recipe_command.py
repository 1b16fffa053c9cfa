"""`hpc recipe convert`: a recipe through the config modifiers (hpc.spec.modifiers), printed, never written.

    hpc recipe convert -r deepseek-r1-disagg --to agg --role decode [--tp 8 --ep 8] [-c eos]
    hpc recipe convert -r my-agg.yaml --to disagg --role decode

Prints the converted recipe (YAML) and each role's merged engine arguments, after the same validation as
`hpc validate` against the cluster (so a conversion that cannot run is one line, exit 2).
"""

from __future__ import annotations

import argparse

import yaml

from hpc.errors import UserError


def add_parsers(sub) -> None:
    p = sub.add_parser("recipe", help="transform a recipe (see: hpc recipe convert -h)")
    verbs = p.add_subparsers(dest="verb", required=True)
    c = verbs.add_parser("convert", help="one role of a disaggregated recipe as an aggregated one, and back")
    c.add_argument("--recipe", "-r", required=True, help="recipe name from recipes/ or a YAML path")
    c.add_argument("--cluster", "-c", default="local", help="cluster profile to validate against (default: local)")
    c.add_argument("--to", required=True, choices=["agg", "disagg"])
    c.add_argument("--role", choices=["prefill", "decode"],
                   help="the role converted (default: what an aggregated recipe says it came from, else decode)")
    c.add_argument("--pool", help="of a role with pools: the pool converted (--to agg)")
    c.add_argument("--tp", type=int, help="tensor-parallel size of the converted role (recipe and engine)")
    c.add_argument("--ep", type=int, help="expert-parallel size of the converted role (a MoE model's: it must "
                                          "divide TP x PP)")
    c.set_defaults(func=convert)


def convert(args: argparse.Namespace) -> int:
    from hpc.resolve import resolve_specs
    from hpc.spec.catalog import load_cluster, load_recipe
    from hpc.spec.modifiers import to_agg, to_disagg, with_parallel

    recipe, path = load_recipe(args.recipe)
    cluster, cluster_path = load_cluster(args.cluster)
    for flag, value in (("--tp", args.tp), ("--ep", args.ep)):
        if value is not None and not 1 <= value <= 4096:
            raise UserError(f"{flag} {value}: a parallel size is from 1 to 4096", field=flag, hint=f"e.g. {flag} 8")
    if args.to == "agg":
        role = args.role or "decode"
        if recipe.roles.agg is not None or getattr(recipe.roles, role) is None:
            raise UserError(f"no {role} role to make aggregated", file=str(path), field=f"roles.{role}",
                            hint="--to agg takes a disaggregated recipe")
        try:
            out, converted = to_agg(recipe, role, args.pool), "agg"
        except ValueError as exc:
            raise UserError(str(exc), file=str(path), field=f"roles.{role}.pools", hint="pass --pool NAME") from None
    else:
        if recipe.roles.agg is None:
            raise UserError("no agg role to split", file=str(path), field="roles.agg",
                            hint="--to disagg takes an aggregated recipe")
        role = args.role or ("prefill" if "hpc_converted_from: prefill" in recipe.description else "decode")
        out, converted = to_disagg(recipe, role), role
    if args.tp is not None or args.ep is not None:
        out = with_parallel(out, converted, tp=args.tp, ep=args.ep)
    resolved = resolve_specs(cluster, cluster_path, out, path)  # relative engine_config paths stay the recipe's
    print(yaml.safe_dump(out.model_dump(mode="json", exclude_defaults=True), sort_keys=False).rstrip())
    for name, engine_args in resolved.engine_args.items():
        print(f"---\n# {name}: merged engine arguments (defaults < engine config < overrides < forced)")
        print(yaml.safe_dump(engine_args, sort_keys=True).rstrip())
    return 0
