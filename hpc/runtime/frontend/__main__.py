"""`python -m hpc.runtime.frontend MANIFEST`: the OpenAI-compatible frontend of one job, under a light supervisor
that starts it again if it dies (frontend.max_restarts): what it held (its KV-aware index) the workers resend,
so the job need not end with it."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from hpc.manifest import Manifest
from hpc.runtime.services.logs import setup_component_logging
from hpc.runtime.services.node import Reporter, failure_line

log = logging.getLogger("hpc.runtime.frontend")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.runtime.frontend")
    parser.add_argument("manifest")
    # the serving process under its supervisor, and which start it is (0 the first)
    parser.add_argument("--attempt", type=int, help=argparse.SUPPRESS)
    # the processes of one frontend after the first (frontend.processes), started by it
    parser.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--primary-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bind", help=argparse.SUPPRESS)
    parser.add_argument("--channel-fd", type=int, help=argparse.SUPPRESS)  # its socketpair with process 0
    args = parser.parse_args(argv)
    name = f"frontend[{args.replica}]" if args.replica else "frontend"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    manifest = Manifest.load(args.manifest)
    setup_component_logging(name, manifest)
    most = manifest.recipe.frontend.max_restarts
    if args.replica == 0 and args.attempt is None and most:
        return _supervise(manifest, args.manifest, most)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    import asyncio

    from hpc.runtime.frontend.group import FrontendGroup
    from hpc.runtime.frontend.server import serve  # the heavy part: tokenizer, router, HTTP server

    size = manifest.plan.service("frontend").processes
    channel = socket.socket(fileno=args.channel_fd) if args.channel_fd is not None else None
    group = FrontendGroup(args.replica, size, args.manifest, args.primary_port, channel) if size > 1 else None
    try:
        return asyncio.run(serve(manifest, args.bind, group))
    except Exception as exc:  # where readiness and status look: the job's checks stop at once, not at a timeout
        if args.replica == 0:  # process 0 speaks for the frontend (it stops when another process fails)
            # a start its supervisor will follow with another is waited for, not the job's failure
            Reporter(manifest, "frontend").phase("failed", error=failure_line(exc),
                                                 restarting=(args.attempt or 0) < most)
        raise


def _supervise(manifest: Manifest, manifest_path: str, most: int) -> int:
    from hpc.runtime.services.supervise import supervise

    reporter = Reporter(manifest, "frontend")

    def after_failure(code: int, attempt: int) -> int | None:
        if attempt >= most:
            log.error("the frontend exited with status %s after %d restarts (frontend.max_restarts): ending its "
                      "step", code, most)
            return code or 1
        reporter.data["restarts"] = attempt + 1
        reporter.phase("restarting", exit_code=code)
        log.warning("the frontend exited with status %s; restart %d of %d", code, attempt + 1, most)
        return None

    return supervise(lambda attempt: [sys.executable, "-m", "hpc.runtime.frontend", manifest_path,
                                      "--attempt", str(attempt)], after_failure)


if __name__ == "__main__":
    sys.exit(main())
