"""The processes a local launch starts for a worker: one per rank for the torch engine (what srun --mpi would
start), one for a TensorRT-LLM worker, whose LLM spawns its own ranks on the worker's GPUs."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from hpc.launch.local import worker_processes
from hpc.resolve import resolve

pytestmark = pytest.mark.unit


def _manifest(recipe: str, overrides: list[str]):
    return resolve("local", recipe, overrides).manifest(Path("/runs/r"), "r", dt.datetime(2026, 1, 2))


def test_a_trtllm_worker_is_one_process_on_its_own_gpus_without_the_slurm_launcher():
    m = _manifest("qwen3-agg", [])  # four TP2 x EP2 workers on one machine
    started = [worker_processes(m, w, "python3", None) for w in m.plan.workers]
    assert [len(s) for s in started] == [1, 1, 1, 1]
    assert [s[0][2]["CUDA_VISIBLE_DEVICES"] for s in started] == ["0,1", "2,3", "4,5", "6,7"]
    assert all("--mpi-launcher" not in s[0][1] and "trtllm-llmapi-launch" not in s[0][1] for s in started)
    assert [m.processes_started(w) for w in m.plan.workers] == [1, 1, 1, 1]
    # the machine's own CUDA_VISIBLE_DEVICES: the plan's GPU numbers index into it
    remapped = [worker_processes(m, w, "python3", "7,6,5,4,3,2,1,0")[0][2]["CUDA_VISIBLE_DEVICES"]
                for w in m.plan.workers]
    assert remapped == ["7,6", "5,4", "3,2", "1,0"]


def test_a_torch_worker_of_two_ranks_is_two_processes_that_pick_their_planned_gpu_themselves():
    m = _manifest("tiny-agg", ["roles.agg.tensor_parallel_size=2"])
    (w,) = m.plan.workers
    started = worker_processes(m, w, "python3", None)
    assert [name for name, _, _ in started] == ["agg-0", "agg-0.rank1"]
    assert [env["HPC_RANK"] for _, _, env in started] == ["0", "1"]
    assert all("CUDA_VISIBLE_DEVICES" not in env for _, _, env in started)
    assert m.processes_started(w) == 2
