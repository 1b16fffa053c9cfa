"""Process entry for a worker: a light supervisor applying the role's failure policy, and the serving child.

Only light imports here: the supervisor must not pay for torch; the child it starts imports the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any, Callable, Coroutine, NoReturn

from hpc.manifest import Manifest
from hpc.runtime.services.logs import setup_component_logging
from hpc.runtime.services.node import Reporter, failure_line
from hpc.spec.recipe import OnFailure

log = logging.getLogger("hpc.worker")


UNDER_LAUNCHER = "HPC_UNDER_MPI_LAUNCHER"


def exec_under_launcher(launcher: str, worker_args: list[str]) -> NoReturn:
    """Become `launcher python -m hpc.runtime.worker ARGS`. Slurm sends the drain signal (SIGUSR1: hpc cancel's
    first tier, or the time limit's warning) to every process of the step; an ignored signal stays ignored across
    fork and exec, so the launcher's shell and the rank processes it starts survive it, while our worker installs
    its own handler and drains."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.environ[UNDER_LAUNCHER] = launcher  # for end_launcher_if_failed (the launcher keeps HPC_* variables)
    try:
        os.execvp(launcher, [launcher, sys.executable, "-m", "hpc.runtime.worker", *worker_args])
    except OSError as exc:
        print(f"hpc worker: cannot start {launcher} ({exc.strerror}); this image lacks it: use one with "
              "TensorRT-LLM's launcher on PATH", file=sys.stderr, flush=True)
        sys.exit(127)


def main_entry(manifest_path: str, role: str, index: int, supervise: bool, attempt: int = 0) -> int:
    # The drain signal before serving starts (loading weights, joining the group) must not kill a rank: ignored
    # until the server installs its drain handler (serve.py); children inherit the ignore.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}-{index} %(levelname)s %(message)s")
    manifest = Manifest.load(manifest_path)
    setup_component_logging(f"{role}-{index}", manifest)
    plan = manifest.plan.worker(role, index)
    if supervise and manifest.processes_started(plan) == 1:
        return supervise_worker(manifest, manifest_path, role, index)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    from hpc.runtime.worker.serve import serve  # the heavy part: engine, torch

    # the role's policy starts it again if it fails (the job script's loop for a worker of several ranks, the
    # supervisor for one): its failed state says so, and readiness waits for the new start instead of failing the job
    restarting = restarts_left(manifest, role, index, attempt)
    try:
        code = run_bounded(serve(manifest, role, index, manifest_path, restarting), on_exit=end_launcher_if_failed)
    except Exception as exc:  # report it where readiness and status look, then fail the step
        rank = _rank_suffix(plan.tasks)
        Reporter(manifest, f"{role}-{index}{rank}").phase("failed", error=failure_line(exc),
                                                         restarting=restarting)
        end_launcher_if_failed(1)
        raise
    end_launcher_if_failed(code)
    return code


def end_launcher_if_failed(code: int) -> None:
    """A failed worker under an MPI launcher takes its rank's launcher down with it. Otherwise the failure would
    be lost: trtllm-llmapi-launch runs the worker in the background and its own comm server in the foreground,
    stops that server once the worker ended, however it ended, and exits 0; the step would end well (or, with
    the other ranks waiting on rank 0, never), and neither the role's restart nor its failure would happen.
    Signalled, the rank's task fails, srun's --kill-on-bad-exit ends the other ranks, and the job script applies
    the role's policy."""
    if code and os.environ.get(UNDER_LAUNCHER):
        log.error("the worker failed (exit %s): ending its rank's %s, so that the role's failure policy applies",
                  code, os.environ[UNDER_LAUNCHER])
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.killpg(os.getpgrp(), signal.SIGTERM)


def run_bounded(main: Coroutine[Any, Any, int], grace_s: float = 5.0,
                on_exit: Callable[[int], None] = lambda code: None) -> int:
    """asyncio.run, except that the tasks still running once `main` returned get `grace_s` to end: a client stuck
    reconnecting to a server that ended with the job (NATS, etcd) must not keep the worker, and its port, alive
    past its step (Slurm's linuxproc tracking loses a process whose parent died: it would outlive the job).
    `on_exit(code)` runs before the process ends that way."""
    import asyncio

    loop = asyncio.new_event_loop()
    code = 1  # unless main returns
    try:
        code = loop.run_until_complete(main)
        return code
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        stuck = loop.run_until_complete(asyncio.wait(pending, timeout=grace_s))[1] if pending else set()
        if stuck:
            log.warning("exiting with %d task(s) that ignored cancellation for %.0f s: %s", len(stuck), grace_s,
                        ", ".join(sorted(str(t.get_coro()) for t in stuck)))
            on_exit(code)
            logging.shutdown()
            os._exit(code)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def restarts_left(manifest: Manifest, role: str, index: int, attempt: int) -> bool:
    """Will the role's failure policy start this worker again after its `attempt`-th restart fails?"""
    policy = manifest.recipe.roles.spec(manifest.plan.worker(role, index).group).failure
    return policy.on_failure is OnFailure.RESTART and attempt < policy.max_restarts


def _rank_suffix(tasks: int) -> str:
    from hpc.runtime.engine.torch.tp import world_rank

    rank = world_rank()[0] if tasks > 1 else 0
    return f".rank{rank}" if rank else ""


def supervise_worker(manifest: Manifest, manifest_path: str, role: str, index: int) -> int:
    """Run the worker as a child; apply the role's failure policy when it dies."""
    from hpc.runtime.services.supervise import supervise

    policy = manifest.recipe.roles.spec(manifest.plan.worker(role, index).group).failure
    cmd = [sys.executable, "-m", "hpc.runtime.worker", manifest_path, "--role", role, "--index", str(index),
           "--no-supervise"]
    reporter = Reporter(manifest, f"{role}-{index}")

    def after_failure(code: int, attempt: int) -> int | None:
        reporter.data["history"].append({"ts": time.time(), "exit_code": code})
        if restarts_left(manifest, role, index, attempt):
            reporter.data["restarts"] = attempt + 1
            reporter.phase("restarting", exit_code=code)
            log.warning("worker exited with %s; restart %d of %d", code, attempt + 1, policy.max_restarts)
            return None
        reporter.phase("failed", exit_code=code)
        if policy.on_failure is OnFailure.CONTINUE:
            log.error("worker exited with %s; policy 'continue' keeps the job running", code)
            return 0
        return code or 1

    return supervise(lambda attempt: [*cmd, "--attempt", str(attempt)], after_failure)
