"""After submission (Slurm or local): readiness with progress, the smoke verdict, and what to do next."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Callable

from hpc.manifest import Manifest
from hpc.rundir import RunDir

if TYPE_CHECKING:
    from hpc.launch.backend import Backend


def preflight_failure(run: RunDir) -> str | None:
    """The preflight step's failure line (a missing module, a wrong Python, no Python at all), if it failed."""
    try:
        lines = [ln.strip() for ln in (run.logs / "preflight.log").read_text(errors="replace").splitlines()]
    except OSError:
        return None
    # every line but a node's "ok" and the first task's record of the job (hpc.checks.jobstart's "hpc: job ...")
    failed = [ln for ln in lines if ln and ": ok (" not in ln and not ln.startswith("hpc: job ")]
    return failed[-1] if failed else None


NEVER_STARTED = ("FAILED", "NODE_FAIL", "BOOT_FAIL")


def unseen_run_dir(run: RunDir, state: str) -> str | None:
    """Why a job failed without a log of its own, if that is why: its batch node could not open
    RUN/logs/job.out, so its script never ran (Slurm: FAILED, exit 0:53, reason JobLaunchFailure). That is what
    a run directory the compute nodes do not see looks like (a login node's /tmp or local disk)."""
    if state not in NEVER_STARTED or (run.logs / "job.out").exists():
        return None
    return (f"the job wrote no log ({run.logs / 'job.out'}): its nodes could not open the run directory. "
            f"Put runs on a filesystem every node mounts: the cluster profile's runs_dir, or HPC_RUNS_DIR")


def timed_out(m: Manifest, state: str) -> str | None:
    """Why a job ended at its time limit, with what to change."""
    if state != "TIMEOUT":
        return None
    drained = (f"; its workers drained from {m.recipe.drain_before_end_s} s before the end"
               if m.recipe.drain_before_end_s else "")
    most = f" (the partition allows {m.cluster.max_time_limit})" if m.cluster.max_time_limit else ""
    return f"the job reached its time limit {m.time_limit}{drained}. For longer serving, set time_limit in the recipe{most}, or chain jobs: hpc launch --chain N"


def follow_up(run: RunDir, t0: float, backend: "Backend", wait: bool, smoke: bool,
              abort: Callable[[], str | None] = lambda: None) -> int:
    """Every backend's launch after the start: readiness, smoke, and what to do next."""
    from hpc.checks.ready import NotReady, wait_ready

    m = run.manifest()
    ref = run.run_info().job_id or run.path.name
    if wait:
        smoke_job = None
        if smoke and m.recipe.smoke.enabled:
            from hpc.launch.smoke import start_smoke

            smoke_job = start_smoke(run, backend, wait_ready_s=m.recipe.runtime.readiness_timeout_s)
        print("waiting for readiness:")
        try:
            wait_ready(m, progress=lambda s: print(s, flush=True), abort=abort)
        except KeyboardInterrupt:
            # Ctrl-C stops the waiting, not the run: say how to reach it, and how to stop it
            if smoke_job is not None:
                smoke_job.cancel(check=False)
            print(f"\nstopped waiting; the run goes on. See it: hpc status {ref}   stop it: hpc cancel {ref}",
                  file=sys.stderr)
            raise
        except NotReady as exc:
            if smoke_job is not None and not backend.smoke_ends_itself:
                smoke_job.cancel(check=False)
            print(f"not ready: {exc}", file=sys.stderr)
            reason = preflight_failure(run)
            if reason:
                print(f"preflight failed: {reason}", file=sys.stderr)
            if backend.end_if_failed(run):
                print(f"inspect: hpc logs {ref}   (the run's other processes were stopped: a failed component "
                      "ends the run, as it ends a Slurm job)", file=sys.stderr)
                return 1
            print(f"inspect: hpc logs {ref}   stop: hpc cancel {ref}", file=sys.stderr)
            return 1
        print(f"ready in {time.monotonic() - t0:.1f} s")
        if smoke_job is not None:
            from hpc.launch.smoke import finish_smoke, verdict_limit
            from hpc.checks.smoke import print_verdict

            verdict = finish_smoke(smoke_job, verdict_limit(run))
            print_verdict(verdict)
            print(f"smoke passed {time.monotonic() - t0:.1f} s after submission" if verdict["passed"] else "")
            if not verdict["passed"]:
                return 1
    url = run.frontend_url() or f"http://<frontend node>:{m.recipe.frontend.port}"
    print(f"\nendpoint: {url}/v1")
    if m.recipe.modality == "video_diffusion":
        print(f"try:      curl {url}/v1/videos -H 'content-type: application/json' "
              f"-d '{{\"model\": \"{m.recipe.model.served_name}\", \"prompt\": \"a red fox in snow\"}}'")
    else:
        print(f"try:      curl {url}/v1/chat/completions -H 'content-type: application/json' "
              f"-d '{{\"model\": \"{m.recipe.model.served_name}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"Hello\"}}], \"max_tokens\": 16}}'")
    until = backend.serves_until(run)
    if until:
        print(f"serves:   {until}")
    ref = run.run_info().job_id or ref  # a job its preflight resubmitted is the one serving
    print(f"next:     hpc status {ref}   hpc logs {ref} --component frontend   hpc cancel {ref}")
    return 0
