"""benchmarks/_cpu_topology.py: the machine's physical cores from sysfs, a core of its own for each engine process,
and which processes are the stack's engines, read from stand-in /sys and /proc trees."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _cpu_topology  # noqa: E402

pytestmark = pytest.mark.unit


def _sysfs(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, listed in siblings.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(listed + "\n")
    return root


def test_hardware_threads_group_into_their_physical_cores(tmp_path):
    root = _sysfs(tmp_path, {0: "0,4", 1: "1,5", 2: "2-3", 3: "2-3", 4: "0,4", 5: "1,5"})
    found = _cpu_topology.cores(root, allowed={0, 1, 2, 3, 4, 5})
    assert found == [(0, 4), (1, 5), (2, 3)]
    assert _cpu_topology.describe(found) == "6 CPUs on 3 physical cores (2 threads a core)"
    # a CPU this process may not use is left out of its core
    assert _cpu_topology.cores(root, allowed={0, 1, 2, 4}) == [(0, 4), (1,), (2,)]


def test_each_engine_gets_a_whole_core_and_the_rest_the_others():
    found = [(0, 4), (1, 5), (2, 6), (3, 7)]
    own, rest = _cpu_topology.split(found, 2)
    assert own == [{2, 6}, {3, 7}] and rest == {0, 1, 4, 5}
    with pytest.raises(ValueError, match="too few"):
        _cpu_topology.split(found, 3)  # one core left for the frontends, workers and clients: refused
    # chosen CPUs: their whole cores, in the engines' order
    own, rest = _cpu_topology.split(found, 2, chosen=[5, 0])
    assert own == [{1, 5}, {0, 4}] and rest == {2, 3, 6, 7}
    for wrong in ([5], [5, 1], [5, 9]):  # too few, one core twice, a CPU the machine lacks
        with pytest.raises(ValueError, match="a CPU of a core of its own"):
            _cpu_topology.split(found, 2, chosen=wrong)


def test_the_engine_processes_of_a_process_group_are_found_by_their_module(tmp_path):
    def process(pid: int, group: int, cmdline: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python3 (x)) S 1 {group} {group} 0 -1\n")
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())

    process(10, 10, "python -m hpc.runtime.worker m.json --role decode")
    process(11, 10, "python -m hpc.runtime.worker m.json --role decode --no-supervise")
    process(12, 10, "python -m hpc.runtime.worker.engine_core m.json --role decode --index 0")
    process(20, 20, "python -m hpc.runtime.worker.engine_core m.json --role prefill --index 0")
    assert sorted(_cpu_topology.group(10, tmp_path)) == [10, 11, 12]
    assert _cpu_topology.engine_pids(10, tmp_path) == [12] and _cpu_topology.engine_pids(20, tmp_path) == [20]


def test_pinning_moves_every_thread_of_a_process():
    allowed = os.sched_getaffinity(0)
    assert _cpu_topology.pin_process(os.getpid(), allowed) >= 1
    assert os.sched_getaffinity(0) == allowed


def _proc_with_a_thread(root: Path, pid: int, tid: int, utime: int, stime: int, voluntary: int,
                        involuntary: int, cpu: int = 0) -> None:
    task = root / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    rest = " ".join(["0"] * 21) + f" {cpu} 0 0 0 0 0"  # fields 18-38, then 39: the CPU it last ran on
    (task / "stat").write_text(f"{tid} (pt (main)) R 1 {pid} {pid} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 {rest}\n")
    (task / "status").write_text(f"Name:\tpython\nvoluntary_ctxt_switches:\t{voluntary}\n"
                                 f"nonvoluntary_ctxt_switches:\t{involuntary}\n")


def test_contention_names_stolen_time_and_the_busiest_threads_switches(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    (tmp_path / "stat").write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3\n")
    machine0 = _cpu_topology.machine_ticks(tmp_path)
    assert machine0 == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 10, "irq": 0, "softirq": 0,
                        "steal": 40}
    _proc_with_a_thread(tmp_path, 7, 7, 0, 0, 0, 0)
    _proc_with_a_thread(tmp_path, 7, 9, tick, 0, 10, 1)
    before = {"decode-0": _cpu_topology.threads(7, tmp_path)}
    assert before["decode-0"][9] == (1.0, 10, 1, 0)
    (tmp_path / "stat").write_text("cpu  400 0 100 1350 10 0 0 140 0 0\n")
    _proc_with_a_thread(tmp_path, 7, 7, tick // 2, 0, 50, 0)  # the idle loop: half a core
    _proc_with_a_thread(tmp_path, 7, 9, 3 * tick, tick, 4010, 301, cpu=5)  # the scheduler: 3 more seconds
    after = {"decode-0": _cpu_topology.threads(7, tmp_path)}
    sysfs = tmp_path / "sys"
    (sysfs / "cpu5" / "node1").mkdir(parents=True)
    line = _cpu_topology.contention(machine0, _cpu_topology.machine_ticks(tmp_path), before, after, 4.0, sysfs)
    # 1,000 ticks spent: 300 + 50 user / system, 550 idle, 100 stolen; the busiest thread is 9, not 7
    assert line == ("machine busy 35%, stolen 10.0%; decode-0 busiest thread 75% of a core on CPU 5 (node 1), "
                    "1000 / 75 switches/s, next 12%")
    # the engine named its scheduler thread: that one, however busy the others
    named = _cpu_topology.contention(machine0, _cpu_topology.machine_ticks(tmp_path), before, after, 4.0, sysfs,
                                     schedulers={"decode-0": 7})
    assert named.endswith("decode-0 scheduler thread 12% of a core on CPU 0, 12 / 0 switches/s, next 75%")


def test_an_engines_scheduler_thread_is_its_busiest_but_the_main_one(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    _proc_with_a_thread(tmp_path, 7, 7, 90 * tick, 0, 0, 0)  # the main thread: imports, the model's load
    _proc_with_a_thread(tmp_path, 7, 8, tick, 0, 0, 0)  # the event loop
    _proc_with_a_thread(tmp_path, 7, 9, 3 * tick, 2 * tick, 0, 0)  # the scheduler's warm-up steps
    assert _cpu_topology.scheduler_thread(7, tmp_path) == 9
    _proc_with_a_thread(tmp_path, 5, 5, tick, 0, 0, 0)
    with pytest.raises(ValueError, match="no thread but its main one"):
        _cpu_topology.scheduler_thread(5, tmp_path)


def test_cores_a_vm_shows_apart_merge_when_they_slow_each_other():
    found = [(0,), (1,), (2,), (3,), (4,), (5,)]
    merged = _cpu_topology.merge_siblings(found, [(1, 4), (5, 2), (7, 0)])  # 7: not among the CPUs
    assert merged == [(0,), (1, 4), (2, 5), (3,)]
    # an engine's core is then both hardware threads: its sibling is kept off the rest of the stack
    own, rest = _cpu_topology.split(merged, 1, chosen=[4])
    assert own == [{1, 4}] and rest == {0, 2, 3, 5}
    assert _cpu_topology.merge_siblings(found, []) == found


def test_pinned_groups_share_a_core_each_and_everything_else_moves_off_first(monkeypatch):
    """pin_threads: the other processes (and this one) go to the other cores before the groups' threads are
    placed, so that a group's thread of this process ends on its core, not back on the rest."""
    calls = []
    monkeypatch.setattr(_cpu_topology, "pin_process", lambda pid, cpus: calls.append(("process", pid, cpus)) or 1)
    monkeypatch.setattr(_cpu_topology.os, "sched_setaffinity", lambda tid, cpus: calls.append(("thread", tid, cpus)))
    found = [(0, 4), (1, 5), (2, 6), (3, 7)]
    own, rest = _cpu_topology.pin_threads([[101, 201], [102]], [50, 60], chosen=None, found=found)
    assert own == [{2, 6}, {3, 7}] and rest == {0, 1, 4, 5}
    assert calls == [("process", 50, rest), ("process", 60, rest), ("process", os.getpid(), rest),
                     ("thread", 101, {2, 6}), ("thread", 201, {2, 6}), ("thread", 102, {3, 7})]


def test_a_pin_options_cpus_default_to_the_last_cores_else_are_the_listed_numbers():
    assert _cpu_topology.chosen_cpus(None) is None and _cpu_topology.chosen_cpus("last") is None
    assert _cpu_topology.chosen_cpus("6,7") == [6, 7]
    for bad in ("x", "6,", "1;$(id)", "`id`", "6 7\n"):
        with pytest.raises(ValueError):
            _cpu_topology.chosen_cpus(bad)
