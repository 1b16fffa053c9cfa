"""The local profile: every component is a process on this machine, in its own session.

Commands are the same as the sbatch script's steps; pids go to local.json so status, logs and cancel
work without Slurm.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpc.errors import UserError
from hpc.render.sbatch import service_argv, worker_argv
from hpc.rundir import RunDir, read_json, write_json


def free_port_base(start: int, span: int) -> int:
    """The first base at or after `start` whose `span` ports are all free on loopback."""
    base = start
    while base + span < 65535:
        if all(_free(base + i) for i in range(span)):
            return base
        base += span
    raise UserError("no free local port range found", hint="set port_base in clusters/local.yaml")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_processes(run: RunDir) -> dict[str, list[int]]:
    m = run.manifest()
    py = sys.executable
    pids: dict[str, list[int]] = {}
    env = {**os.environ, **m.cluster.env, "PYTHONUNBUFFERED": "1"}

    def spawn(name: str, argv: list[str], extra: dict[str, str] | None = None) -> int:
        log = open(run.log_path(name), "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=run.path, env={**env, **(extra or {})}, start_new_session=True)
        log.close()
        return proc.pid

    for s in m.plan.services:
        pids[s.name] = [spawn(s.name, service_argv(m, s.name, py))]
    for w in m.plan.workers:
        role_env = getattr(m.recipe.roles, w.role.value).env
        if w.tasks == 1:
            pids[w.name] = [spawn(w.name, worker_argv(m, w, py), role_env)]
        else:  # what srun --mpi would do: one process per rank
            pids[w.name] = [spawn(f"{w.name}.rank{r}" if r else w.name, worker_argv(m, w, py),
                                  {**role_env, "HPC_RANK": str(r), "HPC_WORLD_SIZE": str(w.tasks),
                                   "HPC_LOCAL_RANK": str(r)}) for r in range(w.tasks)]
    write_json(run.path / "local.json", {"pids": pids, "started": time.time()})
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def local_pids(run: RunDir) -> dict[str, list[int]]:
    return (read_json(run.path / "local.json") or {}).get("pids", {})


def stop_local(run: RunDir, grace_s: float = 10.0) -> list[int]:
    """TERM every process group of the run, then KILL what is left after the grace period."""
    groups = [pid for pids in local_pids(run).values() for pid in pids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in groups:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in groups):
            time.sleep(0.05)
        if not any(alive(p) for p in groups):
            break
    return [p for p in groups if alive(p)]


def launch_local(run: RunDir, wait: bool = True, smoke: bool = True) -> int:
    from hpc.runtime.engine.tiny import ensure_model

    m = run.manifest()
    ensure_model(m.recipe.model.path, m.recipe.model.generate)
    t0 = time.monotonic()
    start_processes(run)
    run.update_run_info(submitted=True, scheduler="local", job_id=run.path.name, submitted_at=time.time())
    print(f"started {m.recipe.name} locally: {run.path.name}")
    return follow_up(run, t0, wait=wait, smoke=smoke)


def follow_up(run: RunDir, t0: float, wait: bool, smoke: bool, abort=lambda: None) -> int:
    """Shared by local and Slurm launches: readiness, smoke, and what to do next."""
    from hpc.runtime.ready import NotReady, wait_ready

    m = run.manifest()
    ref = run.run_info().get("job_id", run.path.name)
    if wait:
        smoke_job = None
        if smoke and m.recipe.smoke.enabled:
            from hpc.launch.smoke import start_smoke

            smoke_job = start_smoke(run, wait_ready_s=m.recipe.runtime.readiness_timeout_s)
        print("waiting for readiness:")
        try:
            wait_ready(m, progress=lambda s: print(s, flush=True), abort=abort)
        except NotReady as exc:
            if smoke_job is not None:
                smoke_job.cancel(check=False)
            print(f"not ready: {exc}", file=sys.stderr)
            print(f"inspect: hpc logs {ref}   stop: hpc cancel {ref}", file=sys.stderr)
            return 1
        print(f"ready in {time.monotonic() - t0:.1f} s")
        if smoke_job is not None:
            from hpc.launch.smoke import finish_smoke
            from hpc.runtime.smoke import print_verdict

            verdict = finish_smoke(smoke_job)
            print_verdict(verdict)
            print(f"smoke passed {time.monotonic() - t0:.1f} s after submission" if verdict["passed"] else "")
            if not verdict["passed"]:
                return 1
    ep = read_json(run.path / "endpoints" / "frontend.json") or {}
    url = ep.get("url", f"http://<frontend node>:{m.recipe.frontend.port}")
    print(f"\nendpoint: {url}/v1")
    print(f"try:      curl {url}/v1/chat/completions -H 'content-type: application/json' "
          f"-d '{{\"model\": \"{m.recipe.model.served_name}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"Hello\"}}], \"max_tokens\": 16}}'")
    print(f"next:     hpc status {ref}   hpc logs {ref} --component frontend   hpc cancel {ref}")
    return 0
