"""The local profile: every component is a process on this machine, in its own session.

Commands are the same as the sbatch script's steps; pids go to local.json so status, logs and cancel
work without Slurm.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from hpc.errors import UserError
from hpc.launch.backend import Cancelled
from hpc.manifest import Manifest
from hpc.plan.placement import WorkerPlan, device_for
from hpc.render.sbatch import service_argv, worker_argv
from hpc.rundir import RunDir, read_json, write_json
from hpc.waiting import wait_until


# A range chosen by a launch stays claimed this long: its servers bind their ports only once they start (a worker
# after loading its model), and a second launch in between would otherwise see the range free and take it too.
PORT_CLAIM_S = 300.0


def free_port_base(start: int, span: int, claims: Path | None = None) -> int:
    """The first base at or after `start` whose `span` ports are all free on loopback and that no other launch
    claimed in the last PORT_CLAIM_S; the choice is claimed under a lock (`claims`: a JSON file shared by every
    local launch of this machine)."""
    claims = claims or Path(tempfile.gettempdir()) / "hpc-local-port-claims.json"
    with open(claims.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        try:
            held = {int(b): t for b, t in json.loads(claims.read_text()).items() if now - t < PORT_CLAIM_S}
        except (OSError, ValueError):
            held = {}
        base = start
        while base + span < 65535:
            if base not in held and all(port_free(base + i) for i in range(span)):
                held[base] = now
                claims.write_text(json.dumps(held))
                return base
            base += span
    raise UserError("no free local port range found", hint="set port_base in clusters/local.yaml")


def port_free(port: int) -> bool:
    """Whether a server could listen on it now: with SO_REUSEADDR as the servers bind, so connections of a stopped
    run still in TIME_WAIT do not count (another listener does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def resolved_env(cluster) -> dict[str, str]:
    """The cluster's env with secrets read on this machine (launch checked that they are there)."""
    return {k: v if isinstance(v, str) else (v.resolve() or "") for k, v in cluster.env.items()}


def start_processes(run: RunDir) -> dict[str, list[int]]:
    m = run.manifest()
    py = sys.executable
    pids: dict[str, list[int]] = {}
    env = {**os.environ, **resolved_env(m.cluster), "PYTHONUNBUFFERED": "1"}

    def spawn(name: str, argv: list[str], extra: dict[str, str] | None = None) -> int:
        log = open(run.log_path(name), "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=run.path, env={**env, **(extra or {})}, start_new_session=True)
        log.close()
        return proc.pid

    for s in m.plan.services:
        pids[s.name] = [spawn(s.name, service_argv(m, s.name, py))]
    for w in m.plan.workers:
        pids[w.name] = [spawn(name, argv, extra) for name, argv, extra in
                        worker_processes(m, w, py, os.environ.get("CUDA_VISIBLE_DEVICES"))]
    write_json(run.layout.local_pids, {"pids": pids, "started": time.time()})
    return pids


def worker_processes(m: Manifest, w: WorkerPlan, python: str,
                     visible: str | None) -> list[tuple[str, list[str], dict[str, str]]]:
    """(log name, argv, extra env) of each process a local worker needs; `visible`: this machine's
    CUDA_VISIBLE_DEVICES, which the plan's GPU numbers index into."""
    role_env = m.recipe.roles.spec(w.group).env
    argv = worker_argv(m, w, python)
    if m.processes_started(w) == 1:
        extra = dict(role_env)
        if m.recipe.backend.value == "trtllm" and m.plan.gpus_per_node:
            # TensorRT-LLM places rank r on the r-th device it sees: only this worker's GPUs, or every worker
            # of the machine would land on GPU 0 (the torch engine picks its planned device itself)
            ids = visible.split(",") if visible else None
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(ids[r.gpu] if ids and r.gpu < len(ids) else str(r.gpu)
                                                     for r in w.ranks)
        return [(w.name, argv, extra)]
    # what srun --mpi would do: one process per rank
    return [(f"{w.name}.rank{r}" if r else w.name, argv,
             {**role_env, "HPC_RANK": str(r), "HPC_WORLD_SIZE": str(w.tasks), "HPC_LOCAL_RANK": str(r)})
            for r in range(w.tasks)]


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
    return (read_json(run.layout.local_pids) or {}).get("pids", {})


def stop_local(run: RunDir, grace_s: float = 10.0, drained: Callable[[], bool] | None = None) -> list[int]:
    """TERM every process group of the run, then KILL what is left after the grace period. With `drained`, first
    hpc cancel's drain tier: SIGUSR1 to each worker's serving process (not its group: processes an engine spawned,
    such as TensorRT-LLM's ranks, would die of it), then up to the grace period for `drained()` (the workers
    finished what they serve)."""
    started = local_pids(run)
    groups = [pid for pids in started.values() for pid in pids]
    if drained is not None and any(alive(pid) for pid in groups):
        states = run.component_states()
        for worker in run.manifest().plan.workers:
            pid = states.get(worker.name, {}).get("pid")
            try:  # only a process of the worker's own group: a stale state's pid may belong to anyone now
                if pid and os.getpgid(pid) in started.get(worker.name, []):
                    os.kill(pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            wait_until(drained, grace_s, "the workers to drain")
        except TimeoutError:
            pass  # the grace period is over: TERM now
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in groups:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            wait_until(lambda: not any(alive(p) for p in groups), grace_s, "the run to stop")
            break
        except TimeoutError:
            continue  # TERM was not enough: KILL
    return [p for p in groups if alive(p)]


def visible_gpus() -> int:
    """NVIDIA GPUs this machine shows its processes, without importing torch (the launcher stays light)."""
    ids = os.environ.get("CUDA_VISIBLE_DEVICES")
    if ids is not None:
        return len([i for i in ids.split(",") if i.strip() and i.strip() != "-1"])
    try:
        return len(list(Path("/proc/driver/nvidia/gpus").iterdir()))
    except OSError:
        return 0


def gpu_sharing(workers: list, gpus: int) -> str | None:
    """One line when the plan wants more GPUs than the machine has: who shares which, as the workers will place
    themselves (device_for, the same rule); None when every worker has its own."""
    placed = {(w.name, r.rank): device_for(w, r.rank, gpus, whole_node=True) for w in workers for r in w.ranks}
    if not any(shared for _, shared in placed.values()):
        return None
    where = ", ".join(f"{name}{'' if rank == 0 else f'.rank{rank}'} -> {device}"
                      for (name, rank), (device, _) in placed.items())
    planned = len({r.gpu for w in workers for r in w.ranks})
    return (f"note: the plan gives each worker its own GPUs ({planned} in all) but this machine "
            f"has {gpus}: workers share them ({where})")


def launch_local(backend: "LocalBackend", run: RunDir, wait: bool, smoke: bool) -> int:
    m = run.manifest()
    if m.recipe.backend.value != "mock":
        note = gpu_sharing(m.plan.workers, visible_gpus())
        if note:
            print(note)
    t0 = time.monotonic()
    pids = start_processes(run)
    run.update_run_info(submitted=True, scheduler="local", job_id=run.path.name, submitted_at=time.time())
    print(f"started {m.recipe.name} locally: {run.path.name}")
    from hpc.launch.follow import follow_up

    return follow_up(run, t0, backend, wait=wait, smoke=smoke, abort=lambda: first_exited(pids))


def end_if_failed(run: RunDir) -> bool:
    """After a launch that did not get ready: a component that failed for good, or exited, ends the run as it ends
    a Slurm job (its script's `wait -n`), so that etcd, NATS and the rest do not serve on, holding ports, with no
    one watching. A run that is only stuck stays up to be inspected. Its logs stay either way."""
    from hpc.checks.ready import failed_for_good

    if not failed_for_good(run.component_states()) and not first_exited(local_pids(run)):
        return False
    stop_local(run, grace_s=5.0)
    run.update_run_info(cancelled_at=time.time())
    return True


def first_exited(pids: dict[str, list[int]]) -> str | None:
    """Why to stop waiting for readiness: a component that exited (they all serve until stopped)."""
    for name, group in pids.items():
        if not all(alive(pid) for pid in group):
            return f"{name} exited"
    return None


class LocalBackend:
    """The local profile: every component a process group on this machine, pids in RUN/local.json."""

    name = "local"
    smoke_ends_itself = True

    def check(self, r) -> None:
        check_local_gpu(r)
        check_local_model(r)
        port = r.recipe.frontend.port
        if not port_free(port):
            raise UserError(f"port {port} is already in use on this machine", field="frontend.port",
                            hint=f"pick another: --set frontend.port={port + 1}")

    def submit(self, run: RunDir, *, wait: bool, smoke: bool) -> int:
        return launch_local(self, run, wait, smoke)

    def status(self, run: RunDir) -> dict:
        info = run.run_info()
        pids = local_pids(run)
        up = sum(1 for ps in pids.values() for p in ps if alive(p))
        total = sum(len(ps) for ps in pids.values())
        state = "RUNNING" if up == total and total else ("DEGRADED" if up else "STOPPED")
        # a stopped run's clock stops when it was cancelled (or, killed some other way, is not known)
        end = info.cancelled_at if state == "STOPPED" else time.time()
        began = info.submitted_at if info.submitted_at is not None else end
        elapsed = f"{end - began:.0f}s" if end is not None and began is not None else "-"
        return {"state": state, "processes": f"{up}/{total}", "elapsed": elapsed,
                "nodes": socket.gethostname()}  # as the components' NODE column names it

    def cancel(self, run: RunDir, grace_s: float, drained: Callable[[], bool]) -> Cancelled:
        left = [str(pid) for pid in stop_local(run, grace_s, drained)]
        return Cancelled(line=f"stopped {run.path.name}" + (f"; still alive: {left}" if left else ""), left=left,
                         stopped=not left)

    def end_if_failed(self, run: RunDir) -> bool:
        return end_if_failed(run)

    def executor(self, run: RunDir, what: str, minutes: int):
        import submitit

        executor = submitit.LocalExecutor(folder=run.path / what)
        executor.update_parameters(timeout_min=minutes)
        return executor

    def serves_until(self, run: RunDir) -> str | None:
        return None


def check_local_model(r) -> None:
    """The model's directories, as the job's preflight checks them on a cluster's nodes: this machine is the node,
    so a path that is not there, or a directory without config.json or tokenizer.json, is one line before any
    server starts (not a frontend's traceback after etcd and NATS came up)."""
    import datetime as dt

    from hpc.checks.preflight import model_problem
    from hpc.model.generated import build_place_problem

    manifest = r.manifest(Path("/nonexistent/check"), "check", dt.datetime.now())
    problem = model_problem(json.loads(manifest.model_dump_json()))
    if r.recipe.model.generate and not problem:
        problem = build_place_problem(r.recipe.model.path)
    if problem:
        raise UserError(problem, file=r.recipe_file)


def check_local_gpu(r) -> None:
    """A recipe whose generated model needs a GPU, launched on a machine without one: one line now, instead of
    workers building the weights on the CPU until they run out of memory or time."""
    from hpc.spec.recipe import GPU_ONLY_MODELS

    needs = GPU_ONLY_MODELS.get(r.recipe.model.generate or "")
    if needs and r.recipe.backend.value != "mock" and visible_gpus() == 0:
        raise UserError(f"{r.recipe.model.generate} needs a GPU ({needs}) and this machine shows none",
                        file=r.recipe_file, field="model.generate",
                        hint="launch it on a GPU machine or a Slurm cluster, or try tiny-agg / tiny-disagg here")
