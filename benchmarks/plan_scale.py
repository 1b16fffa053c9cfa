"""Plan + render time for recipes of 8 ... 1,024 nodes (8 GPUs each). Goal: <= 1 s at 1,024 nodes, linear.

    python benchmarks/plan_scale.py
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from pathlib import Path

from hpc.plan.placement import plan
from hpc.render.sbatch import render_sbatch
from hpc.resolve import resolve_specs
from hpc.spec.cluster import ClusterProfile
from hpc.spec.recipe import Recipe


def specs(nodes: int) -> tuple[ClusterProfile, Recipe]:
    cluster = ClusterProfile(name="bench", nodes_available=nodes, gpus_per_node=8, port_base=10000)
    prefill_workers = nodes // 2  # one TP8 node each
    decode_workers = nodes // 8  # DEP32 over four nodes each
    recipe = Recipe.model_validate({
        "name": f"scale-{nodes}", "model": {"path": "/m", "served_name": "m"}, "backend": "torch",
        "frontend": {"port": 8000},
        "roles": {"prefill": {"count": prefill_workers, "tensor_parallel_size": 8, "expert_parallel_size": 8},
                  "decode": {"count": decode_workers, "tensor_parallel_size": 32, "expert_parallel_size": 32,
                             "enable_attention_dp": True}}})
    return cluster, recipe


def measure(nodes: int, repeats: int = 3) -> tuple[float, float, float, int]:
    cluster, recipe = specs(nodes)
    plan_times, total_times = [], []
    script = ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan(cluster, recipe)
        t1 = time.perf_counter()
        resolved = resolve_specs(cluster, Path("bench.yaml"), recipe, Path("bench.yaml"))
        script = render_sbatch(resolved.manifest(Path("/runs/x"), "x", dt.datetime(2026, 1, 1)))
        t2 = time.perf_counter()
        plan_times.append(t1 - t0)
        total_times.append(t2 - t1)
    return statistics.median(plan_times), statistics.median(total_times), nodes * 8, len(script.splitlines())


def main() -> None:
    print(f"{'nodes':>6} {'gpus':>6} {'plan s':>8} {'validate+plan+render s':>23} {'script lines':>13} {'s/node (ms)':>12}")
    for nodes in (8, 16, 32, 64, 128, 256, 512, 1024):
        p, total, gpus, lines = measure(nodes)
        print(f"{nodes:>6} {gpus:>6} {p:>8.4f} {total:>23.4f} {lines:>13} {1000 * total / nodes:>12.3f}")


if __name__ == "__main__":
    main()
