"""`python -m hpc.runtime.worker MANIFEST --role ROLE --index I`: one worker (all of its MPI ranks)."""

from __future__ import annotations

import argparse
import sys

from hpc.runtime.worker.entry import exec_under_launcher, main_entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.runtime.worker")
    parser.add_argument("manifest")
    parser.add_argument("--role", required=True, choices=["agg", "prefill", "decode", "encode"])
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--no-supervise", action="store_true", help="run the engine in this process")
    parser.add_argument("--attempt", type=int, default=0,
                        help="starts of this worker before this one (the job script's or the supervisor's restarts)")
    parser.add_argument("--mpi-launcher", metavar="COMMAND",
                        help="start this worker under an MPI launcher (trtllm-llmapi-launch), SIGUSR1 ignored in "
                             "everything it starts but the worker")
    args = parser.parse_args(argv)
    if args.mpi_launcher:
        exec_under_launcher(args.mpi_launcher, [args.manifest, "--role", args.role, "--index", str(args.index),
                                                "--attempt", str(args.attempt)])
    return main_entry(args.manifest, args.role, args.index, supervise=not args.no_supervise, attempt=args.attempt)


if __name__ == "__main__":
    sys.exit(main())
