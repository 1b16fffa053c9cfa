"""Dead-worker detection: how long a killed (SIGKILL) or hung (SIGSTOP) worker stays in routing.

    python benchmarks/dead_worker.py [--trials 5]

A killed worker is noticed when its connection drops; a hung one when its 1 s etcd lease expires.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _stack import local_stack  # noqa: E402

from hpc.checks.probe import get_json, post_json  # noqa: E402


def live(url: str) -> int:
    return get_json(url + "/health")[1]["live"].get("agg", 0)


def wait_live(url: str, n: int, timeout: float = 30) -> float:
    t0 = time.monotonic()
    while live(url) != n:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"live != {n}")
        time.sleep(0.005)
    return time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"SIGKILL (connection drop)": [], "SIGSTOP (lease expiry)": []}
    with contextlib.redirect_stdout(io.StringIO()):
        stack = local_stack("mock-agg", "roles.agg.count=2", "roles.agg.failure.on_failure=restart",
                            "roles.agg.failure.max_restarts=100")
        run, url = stack.__enter__()
    try:
        for _ in range(args.trials):
            for label, sig in (("SIGKILL (connection drop)", signal.SIGKILL), ("SIGSTOP (lease expiry)", signal.SIGSTOP)):
                wait_live(url, 2)
                post_json(url + "/v1/completions", {"model": "hpc/mock", "prompt": "x", "max_tokens": 2})
                pid = json.loads((run.state / "agg-0.json").read_text())["pid"]
                t0 = time.monotonic()
                os.kill(pid, sig)
                wait_live(url, 1)
                results[label].append(time.monotonic() - t0)
                if sig == signal.SIGSTOP:
                    os.kill(pid, signal.SIGKILL)  # the supervisor restarts it
                    os.kill(pid, signal.SIGCONT)
    finally:
        stack.__exit__(None, None, None)
    print(f"dead-worker detection on this machine, {args.trials} trials each (frontend /health polled every 5 ms)")
    print(f"{'fault':<28} {'median s':>9} {'max s':>7}")
    for label, values in results.items():
        print(f"{label:<28} {statistics.median(values):>9.3f} {max(values):>7.3f}")


if __name__ == "__main__":
    main()
