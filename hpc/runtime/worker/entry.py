"""Process entry for a worker: a light supervisor applying the role's failure policy, and the serving child.

Only light imports here: the supervisor must not pay for torch; the child it starts imports the engine.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

from hpc.manifest import Manifest
from hpc.runtime.services.node import Reporter
from hpc.spec.recipe import OnFailure

log = logging.getLogger("hpc.worker")


def main_entry(manifest_path: str, role: str, index: int, supervise: bool, attempt: int = 0) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}-{index} %(levelname)s %(message)s")
    manifest = Manifest.load(manifest_path)
    plan = manifest.plan.worker(role, index)
    if supervise and plan.tasks == 1:
        return supervise_worker(manifest, manifest_path, role, index)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    import asyncio

    from hpc.runtime.worker.serve import serve  # the heavy part: engine, torch

    # the role's policy starts it again if it fails (the job script's loop for a worker of several ranks, the
    # supervisor for one): its failed state says so, and readiness waits for the new start instead of failing the job
    restarting = restarts_left(manifest, role, index, attempt)
    try:
        return asyncio.run(serve(manifest, role, index, manifest_path, restarting))
    except Exception as exc:  # report it where readiness and status look, then fail the step
        rank = _rank_suffix(plan.tasks)
        Reporter(manifest, f"{role}-{index}{rank}").phase("failed", error=f"{type(exc).__name__}: {exc}",
                                                         restarting=restarting)
        raise


def restarts_left(manifest: Manifest, role: str, index: int, attempt: int) -> bool:
    """Will the role's failure policy start this worker again after its `attempt`-th restart fails?"""
    policy = manifest.recipe.roles.spec(manifest.plan.worker(role, index).group).failure
    return policy.on_failure is OnFailure.RESTART and attempt < policy.max_restarts


def _rank_suffix(tasks: int) -> str:
    from hpc.runtime.engine.tp import world_rank

    rank = world_rank()[0] if tasks > 1 else 0
    return f".rank{rank}" if rank else ""


def supervise_worker(manifest: Manifest, manifest_path: str, role: str, index: int) -> int:
    """Run the worker as a child; apply the role's failure policy when it dies."""
    policy = manifest.recipe.roles.spec(manifest.plan.worker(role, index).group).failure
    cmd = [sys.executable, "-m", "hpc.runtime.worker", manifest_path, "--role", role, "--index", str(index),
           "--no-supervise"]
    restarts = 0
    stopping = False
    child: subprocess.Popen | None = None

    def stop(signum, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # drain requests reach the engine process directly
    reporter = Reporter(manifest, f"{role}-{index}")
    while True:
        child = subprocess.Popen([*cmd, "--attempt", str(restarts)])
        code = child.wait()
        if stopping or code == 0:
            return 0
        reporter.data["history"].append({"ts": time.time(), "exit_code": code})
        if restarts_left(manifest, role, index, restarts):
            restarts += 1
            reporter.data["restarts"] = restarts
            reporter.phase("restarting", exit_code=code)
            log.warning("worker exited with %s; restart %d of %d", code, restarts, policy.max_restarts)
            continue
        reporter.phase("failed", exit_code=code)
        if policy.on_failure is OnFailure.CONTINUE:
            log.error("worker exited with %s; policy 'continue' keeps the job running", code)
            return 0
        return code or 1
