"""Sampling profiles of the stack's processes under load, with py-spy (optional: `pip install py-spy`): which
thread of each process holds the GIL and in which functions, the question when a component keeps one core busy.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path


def available() -> bool:
    return shutil.which("py-spy") is not None


# what a profile samples: the thread holding the GIL (who keeps the others waiting for it), or every thread
# whatever it is doing, waiting included (where a thread's time goes: a GPU sync, a queue, the GIL)
MODES = {"gil": ["--gil"], "wall": ["--idle"]}


def record(pids: dict[str, int], seconds: int, out_dir: Path,
           native: bool = False) -> list[tuple[str, str, Path, subprocess.Popen]]:
    """py-spy on each process (and its children: the frontend's other processes) for `seconds`, in each of
    MODES, without pausing the process (--nonblocking); or `native`: C frames too, which py-spy reads only from
    a paused process."""
    out_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for name, pid in pids.items():
        for mode, flags in MODES.items():
            path = out_dir / f"{name}.{mode}.txt"
            argv = ["py-spy", "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200", "--format",
                    "raw", "--threads", "--native" if native else "--nonblocking", "--subprocesses", "-o", str(path),
                    *flags]
            running.append((name, mode, path, subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                                               stderr=subprocess.PIPE)))
    return running


# a thread's or the event loop's bootstrap frames: on nearly every stack, they say nothing
_BOOTSTRAP = ("(threading.py)", "(<frozen runpy>)", "(runners.py)", "(__main__.py)")


def _frame(text: str) -> str:
    """'function (path/to/module.py:123)' -> 'function (module.py)': lines merged, one entry per function."""
    name, _, where = text.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':', 1)[0].rstrip(')')})" if where else name


def _code(frames: list[str]) -> list[str]:
    """A stack's functions, root first, without its process and thread names and bootstrap frames."""
    return [f for f in map(_frame, frames)  # unnamed C frames (--native: '0x7f12... (libc.so.6)') say nothing
            if not f.startswith(("thread ", "process ", "0x")) and not f.endswith(_BOOTSTRAP)]


def _samples(path: Path):
    """(thread name, frames root first, sample count) per line of py-spy's raw output."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        name = thread.partition(": ")[2] or thread  # 'thread (1234): torch-engine'
        # with --subprocesses the stacks start 'process 698:"cmdline"': the supervisor's and the worker's
        # MainThread are two threads
        pids = [f.split(":", 1)[0].removeprefix("process ") for f in frames if f.startswith("process ")]
        yield f"{name} (pid {pids[-1]})" if pids else name, frames, int(count)


def summary(path: Path, mode: str, top: int = 12) -> list[str]:
    """gil: per thread its share of the samples; the functions most often on top of the stack (self) and
    anywhere on it (inclusive), as shares of all samples. wall: per thread, where it was (self)."""
    if mode == "wall":
        return _per_thread(path, top)
    threads, self_time, inclusive, total = Counter(), Counter(), Counter(), 0
    for thread, frames, n in _samples(path):
        code = _code(frames)
        total += n
        threads[thread] += n
        if code:
            self_time[code[-1]] += n
            for f in set(code):
                inclusive[f] += n
    if not total:
        return ["  (no samples)"]
    lines = [f"  {total} samples holding the GIL; threads: "
             + ", ".join(f"{t} {n / total:.0%}" for t, n in threads.most_common(4))]
    lines.append("  self:      " + "; ".join(f"{f} {n / total:.1%}" for f, n in self_time.most_common(top)))
    lines.append("  inclusive: " + "; ".join(f"{f} {n / total:.0%}" for f, n in inclusive.most_common(top)))
    return lines


PARKED = ("Popen._try_wait (", "_worker (thread.py", "Thread.run (threading.py")  # leaves of idle helpers


def _leaf(frames: list[str]) -> str:
    """Where a sample's thread was: 'function (module.py:123)' (the line matters); with C frames (--native), the
    last Python frame and the last named C frame under it ('take_gil', 'cudaGraphLaunch'), unnamed ones skipped."""
    def short(frame: str) -> str:
        function, _, where = frame.partition(" (")
        return f"{function} ({where.rsplit('/', 1)[-1]}" if where else function

    named = [f for f in frames if not f.startswith("0x")]
    python = [f for f in named if ".py:" in f]
    if not python or named[-1] is python[-1]:
        return short(named[-1] if named else frames[-1])
    return f"{short(python[-1])} > {short(named[-1])}"


def _per_thread(path: Path, top: int) -> list[str]:
    """Each busy thread's samples by the line it was on (a wait shows as the call that waits)."""
    threads: dict[str, Counter] = {}
    inclusive: dict[str, Counter] = {}  # per thread, the functions anywhere on its stack: where a step's time goes
    for thread, frames, n in _samples(path):
        leaf = _leaf(frames)
        threads.setdefault(thread, Counter())[leaf] += n
        counts = inclusive.setdefault(thread, Counter())
        for f in set(_code(frames)):
            counts[f] += n
    lines = []
    # a thread parked all the time (a supervisor waiting on its child, a pool's idle worker) says nothing and
    # pushed the engine's scheduler thread out of the list
    busy = [(name, where) for name, where in threads.items()
            if sum(n for leaf, n in where.items() if leaf.startswith(PARKED)) < 0.98 * sum(where.values())]
    for name, where in sorted(busy, key=lambda kv: -sum(kv[1].values()))[:6]:
        total = sum(where.values())
        lines.append(f"  wall, {name} ({total} samples): "
                     + "; ".join(f"{w} {n / total:.0%}" for w, n in where.most_common(top)))
        lines.append("    inclusive: " + "; ".join(f"{f} {n / total:.0%}"
                                                   for f, n in inclusive[name].most_common(2 * top)))
    return lines
