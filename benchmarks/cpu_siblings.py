"""Which of a VM's CPUs share a physical core on the host, found by timing: a guest sees one thread a core
(`lscpu`, /sys topology) even when the host runs two of its vCPUs on one core's two hardware threads, and then a
thread runs slower whenever the other is busy — invisible to steal time. On two H200 VMs the decode engine's
step took 0.3 ms in one run and 0.6 ms in the next with the same code and no stolen time (docs/performance-log.md,
sessions 16-18): a hidden sibling would explain it.

    python benchmarks/cpu_siblings.py [--cpus 0-31] [--ms 4] [--repeat 3]

For every ordered pair (i, j): a spinning process on CPU j, a timed loop on CPU i; the loop's time over its time
with every other CPU idle. Prints each CPU's slowest partner and ratio, the pairs slowed by --threshold or more
both ways (hidden siblings), and each CPU's time alone at the end over its time alone at the start (a CPU whose
speed moved on its own). Runs on any Linux machine with two CPUs or more; nothing else may be busy. About 12 ms
a pair: 32 CPUs take 10-20 s, 128 CPUs three minutes (--cpus takes a subset).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cpu_topology import cpu_list  # noqa: E402

SPIN = "while True: pass"


def loop_seconds(iterations: int = 20_000) -> float:
    """A fixed amount of interpreter work (what a scheduler thread's step is made of), timed."""
    t0 = time.perf_counter()
    total = 0
    for k in range(iterations):
        total += k & 7
    return time.perf_counter() - t0


def calibrate(ms: float) -> int:
    """Iterations of loop_seconds that take about `ms` milliseconds on this CPU."""
    n = 10_000
    while True:
        spent = min(loop_seconds(n) for _ in range(3))
        if spent >= ms / 1e3 / 4 or n > 50_000_000:
            return max(int(n * ms / 1e3 / max(spent, 1e-9)), 1_000)
        n *= 4


def slowdowns(cpus: list[int], iterations: int, repeat: int,
              timed: Callable[[int], float] | None = None) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """{(i, j): the loop's time on CPU i with CPU j busy / its time on CPU i alone} (the fastest of `repeat`), and
    {i: CPU i's time alone at the end / at the start}: a CPU whose speed moved on its own while the pairs were
    timed (the host's other load) makes its pairs' ratios say nothing about the pair."""
    def on(cpu: int) -> float:
        os.sched_setaffinity(0, {cpu})
        return min(loop_seconds(iterations) for _ in range(repeat))

    timed = timed or on
    allowed = os.sched_getaffinity(0)  # given back at the end: a caller goes on to run other work
    alone = {i: timed(i) for i in cpus}
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        ratios = {}
        for j in cpus:
            os.sched_setaffinity(spinner.pid, {j})
            time.sleep(0.005)  # the spinner moved and runs there
            for i in cpus:
                if i != j:
                    ratios[(i, j)] = timed(i) / alone[i]
    finally:
        spinner.send_signal(signal.SIGKILL)
        spinner.wait()
    try:
        drift = {i: timed(i) / alone[i] for i in cpus}
    finally:
        os.sched_setaffinity(0, allowed)
    return ratios, drift


def siblings(ratios: dict[tuple[int, int], float], threshold: float) -> list[tuple[int, int, float, float]]:
    """Pairs each slowed by `threshold` or more when the other is busy: (i, j, i's ratio, j's ratio), i < j."""
    found = []
    for (i, j), r in sorted(ratios.items()):
        back = ratios.get((j, i))
        if i < j and back is not None and r >= threshold and back >= threshold:
            found.append((i, j, r, back))
    return found


def report(cpus: list[int], ratios: dict[tuple[int, int], float], threshold: float,
           drift: dict[int, float] | None = None) -> list[str]:
    lines = []
    worst = {i: max(((r, j) for (a, j), r in ratios.items() if a == i), default=(1.0, -1)) for i in cpus}
    typical = sorted(r for r in ratios.values())[len(ratios) // 2] if ratios else 1.0
    lines.append(f"{len(cpus)} CPUs, {len(ratios)} pairs; the median pair's slowdown {typical:.2f}x")
    lines.append("each CPU's slowest partner: " + ", ".join(f"{i}<-{j} {r:.2f}x" for i, (r, j) in worst.items()))
    pairs = siblings(ratios, threshold)
    lines.append(f"hidden siblings (both ways >= {threshold:.2f}x): " + (", ".join(
        f"{i}+{j} ({a:.2f}x/{b:.2f}x)" for i, j, a, b in pairs) if pairs else "none"))
    if drift:
        moved = sorted(drift.items(), key=lambda kv: -abs(kv[1] - 1))
        lines.append("each CPU alone, at the end / at the start: " + ", ".join(
            f"{i} {r:.2f}x" for i, r in moved[:8]) + f" (median {sorted(drift.values())[len(drift) // 2]:.2f}x)")
    return lines


def probe(cpus: list[int], ms: float = 4.0, repeat: int = 3,
          threshold: float = 1.2) -> tuple[list[str], list[tuple[int, int]]]:
    """The report's lines and the sibling pairs found, this process's CPUs as they were afterwards."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        iterations = calibrate(ms)
    finally:
        os.sched_setaffinity(0, allowed)
    t0 = time.perf_counter()
    ratios, drift = slowdowns(cpus, iterations, repeat)
    lines = report(cpus, ratios, threshold, drift) + [f"({time.perf_counter() - t0:.1f} s)"]
    return lines, [(i, j) for i, j, _, _ in siblings(ratios, threshold)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpus", help="the CPUs to test (default: every CPU this process may use)")
    parser.add_argument("--ms", type=float, default=4.0, help="each timed loop's length alone")
    parser.add_argument("--repeat", type=int, default=3, help="loops per measurement (the fastest counts)")
    parser.add_argument("--threshold", type=float, default=1.2, help="the slowdown that marks a sibling")
    args = parser.parse_args()
    allowed = os.sched_getaffinity(0)
    try:
        cpus = cpu_list(args.cpus) if args.cpus else sorted(allowed)
    except ValueError:
        parser.error(f"--cpus {args.cpus!r}: give CPU numbers and ranges, e.g. 0-7,16")
    if set(cpus) - allowed:
        parser.error(f"--cpus: {sorted(set(cpus) - allowed)} not among this process's CPUs {sorted(allowed)}")
    if len(cpus) < 2:
        parser.error("needs two CPUs or more (--cpus)")
    lines, _ = probe(cpus, args.ms, args.repeat, args.threshold)
    print(*lines, sep="\n")


if __name__ == "__main__":
    main()
