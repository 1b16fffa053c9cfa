"""`hpc profile` against a plain `hpc bench` of the recipe it emits: do the profile's figures hold?

    python benchmarks/profile_vs_bench.py [--cluster dev] [--recipe tiny-disagg] [--tp 1,2] [--isl 64] [--osl 16]
                                          [--ttft 200] [--itl 50] [--max-concurrency 8] [--requests 16]

Runs the profile (one allocation, every TP size warm), launches the recipe it wrote, benches it at the profiled
shape and the chosen decode concurrency (twice: the second run shows how much the same measurement moves on this
machine), and prints the chosen point's figures side by side: ITL p50 and output tokens/s at the chosen
concurrency, TTFT p50 at c=1. Goal (issue #17): the profile within 15 % of the bench.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from _stack import local_stack  # noqa: E402

from hpc.cli.main import main  # noqa: E402


def bench(url: str, model: str, isl: int, osl: int, concurrency: list[int], requests: int) -> dict[int, dict]:
    from hpc.bench.clients import run_sweep
    from hpc.bench.loadgen import Level

    levels = [Level(c, isl, osl, max(requests, 4 * c)) for c in concurrency]
    return {lv["concurrency"]: lv for lv in run_sweep(url, model, levels, streaming=True, warmup=4)}


def main_() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--recipe", default="tiny-disagg")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--isl", type=int, default=64)
    parser.add_argument("--osl", type=int, default=16)
    parser.add_argument("--ttft", type=float, default=200)
    parser.add_argument("--itl", type=float, default=50)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], help="a recipe override for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpc-profile-") as tmp:
        out = Path(tmp) / "profile"
        os.environ["HPC_RUNS_DIR"] = str(Path(tmp) / "runs")
        if args.cluster != "local":
            import yaml

            from hpc.spec.catalog import project_root

            conf = yaml.safe_load((project_root() / "clusters" / f"{args.cluster}.yaml").read_text())["slurm_conf"]
            os.environ["SLURM_CONF"] = conf
        cmd = ["profile", "-c", args.cluster, "-r", args.recipe, "--isl", str(args.isl), "--osl", str(args.osl),
               "--ttft", str(args.ttft), "--itl", str(args.itl), "--tp", args.tp, "--max-concurrency",
               str(args.max_concurrency), "--requests", str(args.requests), "--out", str(out)]
        for o in args.set:
            cmd += ["--set", o]
        if main(cmd) != 0:
            return 1
        results = json.loads((out / "profile.json").read_text())
        chosen = results["choice"]["decode"]["chosen"]
        c = chosen["concurrency"]
        prefill = results["choice"]["prefill"]["chosen"]
        overrides = [o for o in args.set if not o.startswith("frontend.port")]
        with local_stack(str(out / "recipe.yaml"), *overrides,
                         cluster=None if args.cluster == "local" else args.cluster) as (run, url):
            model = run.manifest().recipe.model.served_name
            runs = [bench(url, model, args.isl, args.osl, sorted({1, c}), args.requests) for _ in range(2)]

    def figures(got: dict[int, dict]) -> list[float]:
        return [got[c]["itl_s"]["p50"] * 1000, got[c]["output_tokens_per_s"], got[1]["ttft_s"]["p50"] * 1000]
    rows = zip([f"decode ITL p50 (ms) c={c} TP {chosen['tp']}", f"output tok/s c={c}",
                f"TTFT p50 (ms) c=1 TP {prefill['tp']}"],
               [chosen["itl_ms"], chosen["tok_s"], prefill["ttft_ms"]], *[figures(g) for g in runs])
    print(f"\nprofile vs bench of the emitted recipe ({args.recipe} on {args.cluster}, isl {args.isl}, osl {args.osl}):")
    print(f"{'figure':34} {'profile':>9} {'bench 1':>9} {'bench 2':>9} {'profile/bench':>14} {'bench 2/1':>10}")
    worst = 0.0
    for name, prof, first, second in rows:
        mean = (first + second) / 2
        diff = (prof - mean) / mean if mean else float("inf")
        worst = max(worst, abs(diff))
        print(f"{name:34} {prof:9.2f} {first:9.2f} {second:9.2f} {diff:+14.1%} {(second - first) / first:+10.1%}")
    print(f"profile within 15 % of the bench (mean of 2): {'yes' if worst <= 0.15 else 'NO'} (worst {worst:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
