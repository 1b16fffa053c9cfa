"""Launch overhead on the dev cluster: sbatch -> smoke verdict, minus the workers' own load time.

    hpc dev-cluster up [--containers] && python benchmarks/launch_overhead.py [--recipe tiny-disagg] [--runs 3]
        [--clusters dev,dev-containers]

Workers' own time = started -> weights loaded (read from their state files), measured on the bare-process
launch (`dev`). Goals: overhead <= 3 s; in pyxis containers (`dev-containers`) <= 3 s more than bare processes.
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


def one(cluster: str, recipe: str) -> dict[str, float]:
    t0 = time.time()
    with contextlib.redirect_stdout(io.StringIO()):
        code = hpc(["launch", "-c", cluster, "-r", recipe])
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
        return {"submit_to_smoke": smoke["finished"] - info.submitted_at,
                "smoke_s": sum(c["seconds"] for c in smoke["checks"]), "queue_to_first_step":
                first_start - info.submitted_at, "worker_load": load,
                "overhead": smoke["finished"] - info.submitted_at - load, "cli_total": t_done - t0}
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            hpc(["cancel", str((run.run_info().job_id or run.path.name)), "--grace", "2"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="tiny-disagg")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clusters", default="dev", help="comma-separated profiles, e.g. dev,dev-containers")
    args = parser.parse_args()
    conf = yaml.safe_load((project_root() / "clusters" / "dev.yaml").read_text())["slurm_conf"]
    os.environ["SLURM_CONF"] = conf
    clusters = args.clusters.split(",")
    medians = {}
    with tempfile.TemporaryDirectory(prefix="hpc-launch-bench-") as runs:
        os.environ["HPC_RUNS_DIR"] = runs
        for cluster in clusters:
            one(cluster, args.recipe)  # warm-up: hpc's runtime bundle, named containers, page cache
            results = [one(cluster, args.recipe) for _ in range(args.runs)]
            medians[cluster] = {k: statistics.median(r[k] for r in results) for k in results[0]}
    load = medians[clusters[0]]["worker_load"]  # the workers' own time, from the first (bare) profile
    print(f"launch overhead on the dev cluster, recipe {args.recipe}, {args.runs} runs after a warm-up (median)")
    print(f"{'cluster':>16} {'sbatch -> first step':>21} {'workers load':>13} {'sbatch -> smoke pass':>21} "
          f"{'overhead':>9} {'vs ' + clusters[0]:>10}")
    for cluster, med in medians.items():
        overhead = med["submit_to_smoke"] - load
        extra = med["submit_to_smoke"] - medians[clusters[0]]["submit_to_smoke"]
        print(f"{cluster:>16} {med['queue_to_first_step']:>19.2f} s {med['worker_load']:>11.2f} s "
              f"{med['submit_to_smoke']:>19.2f} s {overhead:>7.2f} s {extra:>+8.2f} s")


if __name__ == "__main__":
    main()
