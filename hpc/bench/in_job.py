"""`hpc bench RUN --in-job`: the same sweep, its load generator on one node of the run's cluster (a submitit job,
as the smoke checks run) instead of this machine. A login node is shared and often busy, which shows up as the
client's own latency, and some sites do not let it reach the compute nodes' ports at all. The results land in the
run directory as usual (a filesystem every node sees); this command relays the job's output while it runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from hpc.rundir import RunDir
from hpc.spec.cluster import time_to_minutes


def bench_in_job(args: argparse.Namespace, run: RunDir, on_node: Callable[[argparse.Namespace], int]) -> int:
    """The sweep as a one-node job of the run's cluster (`on_node` runs there: hpc.bench.run.bench_on_node), its
    output relayed as it comes."""
    from hpc.launch.backends import of_run

    remote = argparse.Namespace(**{**vars(args), "in_job": False, "run": str(run.path),
                                   "out": args.out.resolve() if args.out else None})
    from submitit.core.utils import FailedJobError, UncompletedJobError

    cluster = run.manifest().cluster
    job = of_run(run).executor(run, "bench-jobs", time_to_minutes(cluster.time_limit)).submit(on_node, remote)
    print(f"load generator: job {job.job_id} on {cluster.name}; its output follows", flush=True)

    try:
        _relay(job, [(Path(job.paths.stdout), sys.stdout), (Path(job.paths.stderr), sys.stderr)])
        return int(job.result())
    except KeyboardInterrupt:
        job.cancel(check=False)
        raise
    except (FailedJobError, UncompletedJobError) as exc:  # cancelled, timed out, or a crash: not hpc's bug
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"the load generator's job {job.job_id} did not finish: {reason}; its logs: {job.paths.stdout}, "
              f"{job.paths.stderr}", file=sys.stderr)
        return 1


def _relay(job, logs: list[tuple[Path, TextIO]], poll_s: float = 0.3) -> None:
    """Each of the job's logs to its stream here, line by line as it grows, until the job is done; submitit's
    own INFO lines (its start, its result pickle) are left out."""
    shown = [0] * len(logs)
    while True:
        done = job.done()
        for i, (path, stream) in enumerate(logs):
            try:
                new = path.read_bytes()[shown[i]:]
            except OSError:  # not written yet
                continue
            whole = new if done else new[:new.rfind(b"\n") + 1]  # a line still being written waits
            shown[i] += len(whole)
            lines = [ln for ln in whole.decode(errors="replace").splitlines(keepends=True)
                     if not ln.startswith("submitit INFO")]
            if lines:
                stream.write("".join(lines))
                stream.flush()
        if done:
            return
        time.sleep(poll_s)
