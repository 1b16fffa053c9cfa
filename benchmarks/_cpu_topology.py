"""Which CPUs the local stack's processes run on: the machine's cores and hardware threads, and an experiment that
gives each engine process a physical core of its own (`stack_sweeps.py --pin-engines`).

Why: at c=64 the decode engine's scheduler thread is busy all the time, and its step took 0.32-0.34 ms in two runs
and 0.58 ms in a third with the same code on one machine (two H200, a VM of 32 vCPUs running some ten busy
processes). A thread that shares a physical core with another busy one runs markedly slower; this shows the
topology and lets one run keep the engines' cores to themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_ROOT = Path("/sys/devices/system/cpu")
ENGINE_MODULE = "hpc.runtime.worker.engine_core"


def cores(root: Path = CPU_ROOT, allowed: set[int] | None = None) -> list[tuple[int, ...]]:
    """The physical cores as tuples of their hardware threads (CPU numbers), among the CPUs this process may use
    (or `allowed`)."""
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    seen: dict[tuple[int, ...], None] = {}
    for cpu in sorted(allowed):
        siblings = root / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        threads = _cpu_list(siblings.read_text()) if siblings.is_file() else [cpu]
        seen[tuple(t for t in threads if t in allowed)] = None
    return list(seen)


def _cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            out += range(int(first), int(last or first) + 1)
    return out


def describe(found: list[tuple[int, ...]]) -> str:
    threads = sum(map(len, found))
    per_core = sorted({len(core) for core in found})
    return f"{threads} CPUs on {len(found)} physical cores ({'/'.join(map(str, per_core))} threads a core)"


def split(found: list[tuple[int, ...]], engines: int) -> tuple[list[set[int]], set[int]]:
    """A whole physical core for each of `engines` engine processes (the last cores), the rest for everything
    else; ValueError when fewer than two cores would be left to the rest."""
    if len(found) - engines < 2:
        raise ValueError(f"{len(found)} physical cores: too few to give {engines} engine(s) one each")
    own = [set(core) for core in found[len(found) - engines:]]
    rest = {cpu for core in found[:len(found) - engines] for cpu in core}
    return own, rest


def engine_pids(leader: int, proc: Path = Path("/proc")) -> list[int]:
    """The engine processes (`python -m hpc.runtime.worker.engine_core`) in the process group of `leader`."""
    found = []
    for pid in group(leader, proc):
        try:
            cmdline = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ENGINE_MODULE in cmdline:
            found.append(pid)
    return sorted(found)


def group(leader: int, proc: Path = Path("/proc")) -> list[int]:
    """The live processes of `leader`'s process group (a local component and what it started)."""
    pids = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == leader:  # field 5: the process group
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def pin_process(pid: int, cpus: set[int], proc: Path = Path("/proc")) -> int:
    """Every thread of `pid` onto `cpus` (threads it starts later inherit it); returns the threads moved."""
    moved = 0
    for task in (proc / str(pid) / "task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            moved += 1
        except (ProcessLookupError, PermissionError):
            continue
    return moved


def pin_engines(leaders: dict[str, int]) -> list[str]:
    """Each engine process of the stack on a physical core of its own, every other process of the stack and this
    one (and the client processes it starts later) on the other cores. Lines saying what went where."""
    found = cores()
    engines = [(name, pid) for name, leader in sorted(leaders.items()) for pid in engine_pids(leader)]
    own, rest = split(found, len(engines))
    lines = [f"{name}'s engine process {pid}: CPUs {sorted(cpus)} ({pin_process(pid, cpus)} threads)"
             for (name, pid), cpus in zip(engines, own)]
    pinned = {pid for _, pid in engines}
    everyone_else = [p for leader in leaders.values() for p in group(leader) if p not in pinned]
    for pid in everyone_else + [os.getpid()]:
        pin_process(pid, rest)
    lines.append(f"{len(everyone_else)} other processes of the stack and this one: the other {len(rest)} CPUs")
    return lines
