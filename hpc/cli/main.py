"""`hpc`: validate, plan, render and launch LLM serving jobs; status, logs, cancel.

Exit codes: 0 ok, 2 bad input (one message, no traceback), 1 internal error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hpc.cli.args import bounded_int
from hpc.errors import UserError

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors are user errors too: one line, exit 2
        hint = f"see: {self.prog} --help"
        if "expected one argument" in message:
            hint = f"a value that starts with '-' is written --option=VALUE (e.g. --set=PATH=VALUE); {hint}"
        raise UserError(message, hint=hint)


def _add_target(p: argparse.ArgumentParser, default_cluster: str | None = "local", all_recipes: bool = False) -> None:
    p.add_argument("--cluster", "-c", default=default_cluster,
                   help="cluster profile name from clusters/ or a YAML path (default: %(default)s)")
    p.add_argument("--recipe", "-r", required=not all_recipes, help="recipe name from recipes/ or a YAML path")
    if all_recipes:
        p.add_argument("--all", action="store_true", help="every recipe in recipes/, one line each (exit 2 if any "
                                                          "fails): a check for a repository of recipes")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override any recipe field, e.g. --set roles.decode.count=2 (repeatable)")
    p.add_argument("--extra-engine-args", action="append", default=[], metavar="[ROLE=]PATH",
                   help="a TensorRT-LLM engine config YAML for ROLE (every role without ROLE=), as Dynamo's "
                        "worker takes it; replaces the role's engine_config (repeatable)")
    p.add_argument("--override-engine-args", action="append", default=[], metavar="[ROLE=]JSON",
                   help="a JSON object merged over the role's engine arguments, above the YAML (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from hpc.cli import cluster_command, commands, profile_command, recipe_command, runtime_commands

    parser = _Parser(prog="hpc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("validate", help="check a recipe against a cluster; nothing is written")
    _add_target(p, all_recipes=True)
    p.add_argument("--trtllm-version", metavar="V",
                   help="check against TensorRT-LLM V instead of the profile's image: what breaks if I move to V "
                        "('all': every version hpc knows, a table)")
    p.set_defaults(func=commands.validate)

    p = sub.add_parser("plan", help="show which node runs what")
    _add_target(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=commands.show_plan)

    p = sub.add_parser("render", help="print the sbatch script (nothing is written or submitted)")
    _add_target(p)
    p.set_defaults(func=commands.render)

    p = sub.add_parser("launch", help="validate, write the run directory, submit, wait until ready, smoke test")
    _add_target(p)
    p.add_argument("--dry-run", action="store_true", help="write the run directory and stop")
    p.add_argument("--no-wait", action="store_true", help="return after submission")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke tests after readiness")
    p.add_argument("--in-allocation", action="store_true",
                   help="run in the allocation this shell holds (salloc, SLURM_JOB_ID) instead of submitting a job; "
                        "hpc cancel then ends the run's steps, not the allocation")
    p.add_argument("--chain", type=bounded_int(2, 1000, "a chain is 2 or more jobs"), metavar="N",
                   help="serve past the time limit: N jobs one after another, each queued --handover seconds "
                        "before the last one's end; hpc endpoint RUN is their one address")
    p.add_argument("--handover", type=bounded_int(1, 7 * 86400, "seconds"), metavar="SECONDS",
                   help="with --chain: how long before a job's end the next one is queued (default 600, at most "
                        "a quarter of the time limit)")
    p.set_defaults(func=commands.launch)

    p = sub.add_parser("recipes", help="list recipes")
    p.set_defaults(func=commands.list_recipes)
    p = sub.add_parser("clusters", help="list cluster profiles")
    p.set_defaults(func=commands.list_clusters)

    recipe_command.add_parsers(sub)
    cluster_command.add_parsers(sub)
    profile_command.add_parser(sub, _add_target)
    runtime_commands.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hpc status | head`: the reader left, nothing went wrong
        sys.stderr.close()
        return 0
    except Exception:  # internal bug: keep the traceback for the report
        import traceback

        traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
