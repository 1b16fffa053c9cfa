"""Start a recipe's whole stack on this machine for a benchmark, and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from hpc.cli.main import main
from hpc.launch.local import stop_local
from hpc.rundir import RunDir, list_runs


def workers(run_path: Path) -> dict[str, dict]:
    """Each worker rank's state (device, metrics URL) as it reported it."""
    from hpc.bench.engines import worker_states

    return worker_states(run_path)


WORKER_COUNTERS = ("requests", "kv_ipc_shared", "prompt_tokens", "prompt_tokens_computed", "prompt_tokens_cached")


def counters(metrics_url: str, names: tuple[str, ...] = WORKER_COUNTERS) -> dict[str, float]:
    """A worker's counters that the benchmarks report, from its /metrics."""
    from hpc.bench.engines import worker_counters

    return worker_counters(metrics_url, names)


def add_set_option(parser) -> None:
    """--set PATH=VALUE for the stack's recipe (hpc launch's), e.g. frontend.processes=1."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="a recipe override for the stack, e.g. frontend.processes=1 (repeatable)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_stack(recipe: str, *overrides: str, cluster: str | None = None) -> Iterator[tuple[RunDir, str]]:
    """The stack on this machine, or (`cluster`: a Slurm profile such as dev) as a job there, stopped afterwards."""
    if cluster:
        import yaml

        from hpc.spec.catalog import project_root

        conf = yaml.safe_load((project_root() / "clusters" / f"{cluster}.yaml").read_text()).get("slurm_conf")
        if conf:
            os.environ["SLURM_CONF"] = conf
    with tempfile.TemporaryDirectory(prefix="hpc-bench-") as runs:
        os.environ["HPC_RUNS_DIR"] = runs
        args = ["launch", "-r", recipe, "--no-smoke", "--set", f"frontend.port={free_port()}"]
        args += ["-c", cluster] if cluster else []
        for o in overrides:
            args += ["--set", o]
        code = main(args)
        if code != 0 and not list_runs():
            raise SystemExit(f"launch of {recipe} failed before it wrote a run directory (the error is above)")
        run = list_runs()[0]
        try:
            if code != 0:  # the run directory goes with the temporary one: its logs are kept apart
                kept = shutil.copytree(run.path, tempfile.mkdtemp(prefix="hpc-bench-failed-"), dirs_exist_ok=True)
                raise SystemExit(f"launch of {recipe} failed; logs in {Path(kept) / 'logs'}")
            url = run.frontend_url()
            if url is None:
                raise SystemExit(f"{recipe}: the frontend said nowhere it listens (run {run.path.name})")
            yield run, url
        finally:
            if cluster:
                main(["cancel", str((run.run_info().job_id or run.path.name)), "--grace", "2"])
            else:
                stop_local(run, 5)
