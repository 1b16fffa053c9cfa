"""Which CPUs the local stack's processes run on: the machine's cores and hardware threads, how contended they
were (stolen time, each engine's scheduler thread's share of a core and its context switches), and an experiment
that gives each engine's scheduler thread a physical core of its own (`stack_sweeps.py --pin-engines`).

Why: at c=64 the decode engine's scheduler thread is busy all the time, and its step took 0.32-0.34 ms in two runs
and 0.58 ms in a third with the same code on one machine (two H200, a VM of 32 vCPUs running some ten busy
processes). A thread that shares a physical core with another busy one runs markedly slower; this shows the
topology and lets one run keep the schedulers' cores to themselves. (The two-H200 VMs show 32 CPUs on 32 cores,
one thread a core; what the host shares beneath shows as stolen time.)
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
        threads = cpu_list(siblings.read_text()) if siblings.is_file() else [cpu]
        seen[tuple(t for t in threads if t in allowed)] = None
    return list(seen)


def cpu_list(text: str) -> list[int]:
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


def split(found: list[tuple[int, ...]], engines: int,
          chosen: list[int] | None = None) -> tuple[list[set[int]], set[int]]:
    """A whole physical core for each of `engines` engine processes (the last cores, or those of the `chosen`
    CPUs, one an engine), the rest for everything else; ValueError when fewer than two cores would be left to
    the rest, or the chosen CPUs are not one an engine, each on a core of its own."""
    if len(found) - engines < 2:
        raise ValueError(f"{len(found)} physical cores: too few to give {engines} engine(s) one each")
    if chosen is None:
        own = [set(core) for core in found[len(found) - engines:]]
    else:
        core_of = {cpu: core for core in found for cpu in core}
        if len(chosen) != engines or any(cpu not in core_of for cpu in chosen) \
                or len({core_of[cpu] for cpu in chosen}) != engines:
            raise ValueError(f"CPUs {chosen}: give each of the {engines} engine(s) a CPU of a core of its own "
                             f"among {sorted(core_of)}")
        own = [set(core_of[cpu]) for cpu in chosen]
    taken = set().union(*own)
    rest = {cpu for core in found for cpu in core if cpu not in taken}
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


def merge_siblings(found: list[tuple[int, ...]], pairs: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    """`found`'s cores, those that share a physical core on the host (pairs that slow each other down,
    cpu_siblings.py) merged into one: a VM's topology shows one thread a core whatever the host does."""
    core_of = {cpu: i for i, core in enumerate(found) for cpu in core}
    parent = list(range(len(found)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for a, b in pairs:
        if a in core_of and b in core_of:
            parent[root(core_of[a])] = root(core_of[b])
    merged: dict[int, list[int]] = {}
    for i, core in enumerate(found):
        merged.setdefault(root(i), []).extend(core)
    return [tuple(sorted(cpus)) for _, cpus in sorted(merged.items(), key=lambda kv: min(kv[1]))]


def pin_engines(leaders: dict[str, int], chosen: list[int] | None = None,
                schedulers: dict[str, int] | None = None, found: list[tuple[int, ...]] | None = None) -> list[str]:
    """Each engine's scheduler thread on a physical core of its own (of `found`, by default the kernel's view);
    every other thread of the stack (the engines' other threads too) and this process (and the client processes
    it starts later) on the other cores. Lines saying what went where. (Pinning an engine's every thread to one
    core put its event loop and CUDA's threads on its scheduler's core.)"""
    engines = [(name, pid) for name, leader in sorted(leaders.items()) for pid in engine_pids(leader)]
    # each engine's scheduler thread: as the engine names it, else a guess
    tids = [(schedulers or {}).get(name) or scheduler_thread(pid) for name, pid in engines]
    stack = [p for leader in leaders.values() for p in group(leader)]
    pinned, rest = pin_threads([[tid] for tid in tids], stack, chosen, found)
    lines = [f"{name}'s engine process {pid}: its scheduler thread {tid} on CPUs {sorted(cpus)}"
             for (name, pid), tid, cpus in zip(engines, tids, pinned)]
    lines.append(f"{len(stack)} processes of the stack (the engines' other threads) and this one: the other "
                 f"{len(rest)} CPUs")
    return lines


def chosen_cpus(setting: str | None) -> list[int] | None:
    """A --pin-* option's CPUs: None for the default (no value, or `last`: the last cores), else the listed CPU
    numbers; ValueError for anything else."""
    return None if setting in (None, "last") else [int(cpu) for cpu in setting.split(",")]


def pin_threads(groups: list[list[int]], pids: list[int], chosen: list[int] | None = None,
                found: list[tuple[int, ...]] | None = None) -> tuple[list[set[int]], set[int]]:
    """Each group of threads on a physical core of its own (split: the last cores, or the `chosen` CPUs' cores),
    every thread of `pids` and of this process on the other cores, before the groups are placed; (the groups'
    CPUs, the others)."""
    own, rest = split(cores() if found is None else found, len(groups), chosen)
    for pid in pids + [os.getpid()]:
        pin_process(pid, rest)
    for tids, cpus in zip(groups, own):
        for tid in tids:
            os.sched_setaffinity(tid, cpus)
    return own, rest


def scheduler_thread(pid: int, proc: Path = Path("/proc")) -> int:
    """An engine process's scheduler thread: its busiest thread but the main one (which loaded the model; the
    scheduler's warm-up steps make it the busiest of the others)."""
    others = {tid: reading[0] for tid, reading in threads(pid, proc).items() if tid != pid}
    if not others:
        raise ValueError(f"engine process {pid} has no thread but its main one")
    return max(others, key=others.__getitem__)


STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_ticks(proc: Path = Path("/proc")) -> dict[str, int]:
    """The machine's CPU time so far by kind, in clock ticks (/proc/stat's first line). `steal` is time this VM's
    vCPUs were ready to run while the host ran something else."""
    values = (proc / "stat").read_text().split("\n", 1)[0].split()[1:1 + len(STAT_FIELDS)]
    return dict(zip(STAT_FIELDS, map(int, values)))


def threads(pid: int, proc: Path = Path("/proc")) -> dict[int, tuple[float, int, int, int]]:
    """Each thread of `pid`: (CPU seconds, voluntary, involuntary context switches) so far, and the CPU it last ran
    on. An involuntary switch is the kernel taking the CPU from a thread that could have gone on running."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for task in (proc / str(pid) / "task").glob("[0-9]*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
            out[int(task.name)] = ((int(fields[11]) + int(fields[12])) / tick,  # stat fields 14, 15: utime, stime
                                   int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]),
                                   int(fields[36]))  # field 39: the CPU it last ran on
        except (OSError, IndexError, KeyError, ValueError):
            continue
    return out


def numa_node(cpu: int, root: Path = CPU_ROOT) -> int | None:
    """The NUMA node a CPU belongs to (its nodeN entry in sysfs), or None where the machine shows none."""
    found = sorted((root / f"cpu{cpu}").glob("node[0-9]*"))
    return int(found[0].name.removeprefix("node")) if found else None


def contention(machine0: dict[str, int], machine1: dict[str, int], threads0: dict[str, dict[int, tuple]],
               threads1: dict[str, dict[int, tuple]], seconds: float, root: Path = CPU_ROOT,
               schedulers: dict[str, int] | None = None) -> str:
    """One line: the machine's busy and stolen share of its CPU time between two readings, and each named
    process's scheduler thread (its OS id in `schedulers`; else its busiest thread): its share of a core, its
    context switches a second (voluntary / involuntary) and the CPU it ran on last (and its NUMA node); then the
    busiest other thread's share (the event loop, which takes the GIL from the scheduler whenever it runs)."""
    spent = {k: machine1[k] - machine0[k] for k in STAT_FIELDS}
    total = max(sum(spent.values()), 1)
    running = sum(spent[k] for k in ("user", "nice", "system", "irq", "softirq"))
    parts = [f"machine busy {running / total:.0%}, stolen {spent['steal'] / total:.1%}"]
    for name, after in threads1.items():
        before = threads0.get(name, {})
        deltas = {tid: tuple(a - b for a, b in zip(now[:3], before.get(tid, (0.0, 0, 0)))) + (now[3],)
                  for tid, now in after.items()}
        if not deltas:
            continue
        named = (schedulers or {}).get(name)
        tid = named if named in deltas else max(deltas, key=deltas.__getitem__)
        cpu, voluntary, involuntary, ran_on = deltas.pop(tid)
        node = numa_node(ran_on, root)
        label = "scheduler thread" if tid == named else "busiest thread"
        parts.append(f"{name} {label} {cpu / seconds:.0%} of a core on CPU {ran_on}"
                     + (f" (node {node})" if node is not None else "")
                     + f", {voluntary / seconds:.0f} / {involuntary / seconds:.0f} switches/s"
                     + (f", next {max(deltas.values())[0] / seconds:.0%}" if deltas else ""))
    return "; ".join(parts)
