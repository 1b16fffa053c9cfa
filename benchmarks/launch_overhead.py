"""Launch overhead on the dev cluster: sbatch -> smoke verdict, minus the workers' own load time.

    hpc dev-cluster up && python benchmarks/launch_overhead.py [--recipe tiny-disagg] [--runs 3]

Workers' own time = started -> weights loaded (read from their state files). Goal: overhead <= 3 s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time

import yaml

from hpc.cli.main import main as hpc
from hpc.rundir import list_runs
from hpc.spec.catalog import project_root


def one(recipe: str) -> dict[str, float]:
    t0 = time.time()
    with contextlib.redirect_stdout(io.StringIO()):
        code = hpc(["launch", "-c", "dev", "-r", recipe])
    t_done = time.time()
    run = list_runs()[0]
    try:
        if code != 0:
            raise SystemExit(f"launch failed: see {run.logs}")
        info = run.run_info()
        states = run.component_states()
        workers = [w.name for w in run.manifest().plan.workers]
        # the workers' own time: process exec (imports included) -> weights loaded
        load = max(states[w]["phases"]["weights_loaded"] - states[w]["phases"]["process_start"] for w in workers)
        first_start = min(s["phases"]["process_start"] for s in states.values() if "phases" in s)
        smoke = json.loads((run.path / "smoke.json").read_text())
        return {"submit_to_smoke": smoke["finished"] - info["submitted_at"],
                "smoke_s": sum(c["seconds"] for c in smoke["checks"]), "queue_to_first_step":
                first_start - info["submitted_at"], "worker_load": load,
                "overhead": smoke["finished"] - info["submitted_at"] - load, "cli_total": t_done - t0}
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            hpc(["cancel", str(run.run_info().get("job_id", run.path.name)), "--grace", "2"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="tiny-disagg")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    conf = yaml.safe_load((project_root() / "clusters" / "dev.yaml").read_text())["slurm_conf"]
    os.environ["SLURM_CONF"] = conf
    with tempfile.TemporaryDirectory(prefix="hpc-launch-bench-") as runs:
        os.environ["HPC_RUNS_DIR"] = runs
        results = [one(args.recipe) for _ in range(args.runs)]
    print(f"launch overhead on the dev cluster, recipe {args.recipe}, {args.runs} runs (median)")
    print(f"{'sbatch -> first step':>22} {'workers load':>13} {'smoke checks':>13} {'sbatch -> smoke pass':>21} "
          f"{'overhead':>9}")
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(f"{med['queue_to_first_step']:>20.2f} s {med['worker_load']:>11.2f} s {med['smoke_s']:>11.2f} s "
          f"{med['submit_to_smoke']:>19.2f} s {med['overhead']:>7.2f} s")


if __name__ == "__main__":
    main()
