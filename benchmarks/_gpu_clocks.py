"""The GPUs' SM clocks while a benchmark runs, sampled by `nvidia-smi -lms`: a first sweep slower than the second at
low load may be a GPU that had not raised its clock yet (it idled while the stack started), not the code. Nothing
here changes a clock; without nvidia-smi the log stays empty and says so."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

FIELDS = "index,clocks.sm,clocks.max.sm,pstate"


class ClockLog:
    def __init__(self, interval_ms: int = 50) -> None:
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, int, float]] = []  # (wall time, GPU index, SM MHz)
        self.max_mhz: dict[int, float] = {}
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "ClockLog":
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                                           f"-lms={self.interval_ms}"], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:  # one line per GPU per sample, stamped as it arrives
            parts = [p.strip() for p in line.split(",")]
            try:
                index, mhz, top = int(parts[0]), float(parts[1]), float(parts[2])
            except (ValueError, IndexError):
                continue
            self.samples.append((time.time(), index, mhz))
            self.max_mhz[index] = top

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._reader.join(timeout=5)

    def mean(self, began: float, ended: float) -> dict[int, float]:
        """Each GPU's mean SM clock (MHz) over the samples taken between two wall times."""
        by_gpu: dict[int, list[float]] = {}
        for t, index, mhz in self.samples:
            if began <= t <= ended:
                by_gpu.setdefault(index, []).append(mhz)
        return {index: sum(v) / len(v) for index, v in sorted(by_gpu.items())}

    def report(self, spans: dict[str, list[tuple[float, float]]]) -> str:
        """One line per GPU: its mean SM clock in each named span, one figure per repeat (each sweep)."""
        if not self.samples:
            return "GPU SM clocks: not sampled (no nvidia-smi)"
        lines = []
        for index in sorted(self.max_mhz):
            cells = []
            for name, repeats in spans.items():
                means = [self.mean(a, b).get(index) for a, b in repeats]
                cells.append(f"{name} " + " / ".join("-" if m is None else f"{m:.0f}" for m in means))
            lines.append(f"GPU {index} SM clock, mean MHz (max {self.max_mhz[index]:.0f}) in each sweep: "
                         + ", ".join(cells))
        return "\n".join(lines)
