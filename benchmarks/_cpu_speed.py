"""How fast this machine's CPUs run while a benchmark runs: a fixed piece of interpreter work, timed over and over
by a process of its own on whatever core is free. On these VMs a vCPU's speed drifts by tens of percent within a
minute (docs/performance-log.md, sessions 18 and 24): a sweep that is slower than the one before may be a slower
machine, not slower code. The probe takes one core; below MIN_CPUS it does not run and says so.

    python benchmarks/_cpu_speed.py   # the probe itself: `WALL_TIME MICROSECONDS CPU` lines, one every ~20 ms
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

from hpc.runtime.engine.torch.cpu_reference import reference_seconds

MIN_CPUS = 8
_REPEATS = 20  # reference runs per line: their best, so that an interrupt does not read as a slow machine


def reference_us() -> float:
    """The engine's CPU reference (hpc/runtime/engine/torch/cpu_reference.py), 2,000 rounds, in µs: a step's time over
    this one compares across machines and across the minutes in which a VM's vCPUs change speed."""
    return reference_seconds(2000) * 1e6


class CpuSpeedLog:
    """The probe process while the block runs; `report` gives the machine's speed in named spans of wall time."""

    def __init__(self, min_cpus: int = MIN_CPUS) -> None:
        self.enabled = (os.cpu_count() or 1) >= min_cpus
        self.samples: list[tuple[float, float, int]] = []  # (wall time, best reference µs, the CPU it ran on)
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "CpuSpeedLog":
        if self.enabled:
            self._proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                wall, us, cpu = line.split()
                self.samples.append((float(wall), float(us), int(cpu)))
            except ValueError:
                continue

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._reader.join(timeout=5)

    def median_us(self, began: float, ended: float) -> float | None:
        inside = [us for t, us, _ in self.samples if began <= t <= ended]
        return statistics.median(inside) if inside else None

    def report(self, spans: dict[str, list[tuple[float, float]]]) -> str:
        """The machine's speed in each named span, one figure per repeat (each sweep): the fastest span's median
        reference time over this span's, so 100 % is the run's fastest and 80 % a CPU a fifth slower."""
        if not self.enabled:
            return f"CPU speed: not probed (fewer than {MIN_CPUS} CPUs: the probe would take one the stack needs)"
        medians = {name: [self.median_us(a, b) for a, b in repeats] for name, repeats in spans.items()}
        found = [m for ms in medians.values() for m in ms if m is not None]
        if not found:
            return "CPU speed: no probe samples"
        fastest = min(found)
        cells = [f"{name} " + " / ".join("-" if m is None else f"{fastest / m:.0%}" for m in ms)
                 for name, ms in medians.items()]
        by_cpu: dict[int, list[float]] = {}
        for _, us, cpu in self.samples:
            by_cpu.setdefault(cpu, []).append(us)
        # the same loop on each CPU the probe was moved to: a VM's vCPUs need not run at one speed
        on_each = ", ".join(f"{cpu} {fastest / statistics.median(v):.0%} ({len(v)})" for cpu, v in sorted(
            by_cpu.items(), key=lambda item: -len(item[1])))
        return (f"CPU speed in each sweep (a reference loop on a free core, against the run's fastest span, "
                f"{fastest:.1f} µs): " + ", ".join(cells) + f"; on each CPU it ran on (samples): {on_each}")


def _cpu_now() -> int:
    """The CPU this process last ran on (/proc/self/stat's field 39, `processor`)."""
    with open("/proc/self/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[36])


def _probe() -> None:
    while True:
        best = min(reference_us() for _ in range(_REPEATS))
        print(f"{time.time():.4f} {best:.3f} {_cpu_now()}", flush=True)
        time.sleep(0.02)


if __name__ == "__main__":
    try:
        _probe()
    except (BrokenPipeError, KeyboardInterrupt):
        pass
