"""The GPU suite in one command, for one GPU-machine call. By default it runs the steps that measure issue #14's
goals (_goals.py: the stack's sweeps and its share of the engine, both KV handoffs, the 8B shape's roofline and TP=2
tokens, the parallel layouts over NCCL: about 400 s on two H200), then prints and stores one verdict a goal.
`--only a,b` runs the named steps (`--only cuda_tests`: the CUDA tests, a call of their own); `--all` every step,
the diagnostics of earlier sessions too (more than one call holds).

    python benchmarks/gpu_suite.py --out gpu_suite.json [--mpiexec "mpirun --allow-run-as-root"] [--budget 560]

Steps run one after another, each with its own time limit taken from what is left of `--budget` seconds, so the
suite ends inside a 10-minute call even when a step hangs; a step that fails or runs out of time is recorded as
such and the others still run. Exits non-zero when any step failed. A goal not met is a verdict, not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from _goals import GOAL_STEPS, table, verdicts

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


Step = tuple[str, list[str], str | None, int]
# the engine's two sweeps first: on a fresh machine they tune the tiny model's GEMVs (a minute, kept in Triton's
# disk cache), which the stack's steps would otherwise pay inside their own limits
DEFAULT_STEPS = ["engine_sweeps", *GOAL_STEPS]


def steps(mpiexec: str, scratch: str, gpus: int, profiles: str | None) -> list[Step]:
    """(name, argv, JSON file it writes or None, seconds it may take at most)."""
    py = sys.executable
    # where each component's time and GIL go at the highest concurrency, when py-spy is installed and asked for
    profile = ["--profile", profiles] if profiles and shutil.which("py-spy") else []
    return [
        # a call of their own (--only cuda_tests): 200 s ran 24 of these 74 on two H200, its GEMVs' tuning included
        ("cuda_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runtime/test_engine_cuda.py",
                        "tests/runtime/test_fused_decode.py", "tests/runtime/test_engine_warmup.py",
                        "tests/runtime/test_kv_ipc_cuda.py", "tests/runtime/test_decode_graphs.py",
                        "tests/runtime/test_prefill_graphs.py", "tests/runtime/test_overlap.py",
                        "tests/runtime/test_chunked_prefill.py", "tests/runtime/test_attention_paths.py",
                        "tests/runtime/test_prefix_cache.py", "tests/runtime/test_peer_reduce.py"], None, 540),
        # every test marked gpu across the tree: session 31 found one in tests/bench that had never run on a GPU,
        # outside the files above. The NCCL layouts and the video DiT (it needs av, which the GPU machine lacks
        # unless carried) have steps of their own. One H200: 22 passed in 140 s
        ("gpu_marked_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests",
                              "--ignore=tests/runtime/test_parallel_layouts.py",
                              "--ignore=tests/runtime/test_video.py"], None, 240),
        # several decode steps a replay (real CUDA graphs against one step; stand-ins at four and eight) and the
        # engine-process stack's counts at four: session 28 changed both and could not rerun them on a GPU
        ("multi_step_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests/runtime/test_decode_multi_step.py", "tests/runtime/worker/test_engine_process.py",
                              "-k", "multi_step or own"], None, 150),
        # the chunks alone, for a call short of time
        ("chunked_prefill_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "tests/runtime/test_chunked_prefill.py"], None, 60),
        ("gpu_check_0.9b", [py, "benchmarks/gpu_check.py", "--shape", "1b", "--mpiexec", mpiexec, "--json",
                            f"{scratch}/1b.json"], f"{scratch}/1b.json", 150 * gpus),
        # TP=2 too on two GPUs; the compiled torch path's comparison in gpu_check_8b_vs_torch
        ("gpu_check_8b", [py, "benchmarks/gpu_check.py", "--shape", "8b", "--mpiexec", mpiexec, "--no-torch-path",
                          "--json", f"{scratch}/8b.json"], f"{scratch}/8b.json", 120 * gpus),
        ("gpu_check_8b_vs_torch", [py, "benchmarks/gpu_check.py", "--shape", "8b", "--mpiexec", mpiexec],
         None, 210 * gpus),
        # the 8B shape's batch-1 step under the decode kernels' knobs (each in alternating rounds), TP=1 and TP=2
        ("decode_knobs_8b", [py, "benchmarks/decode_knobs.py", "--rounds", "2"], None, 120),
        ("decode_knobs_8b_tp2", [*mpiexec.split(), "-n", "2", py, "benchmarks/decode_knobs.py", "--rounds", "2"],
         None, 150),
        ("kv_handoff", [py, "benchmarks/kv_handoff.py", "--tokens", "2000", "--handoffs", "8", "--json",
                        f"{scratch}/kv.json"], f"{scratch}/kv.json", 60),
        # NIXL (when the nixl extra is installed): UCX held to TCP + staging, as between two nodes without RDMA
        ("kv_handoff_nixl_tcp", [py, "benchmarks/kv_handoff.py", "--tokens", "2000", "--handoffs", "8",
                                 "--ucx-tls", "tcp,cuda_copy"], None, 90),
        # the transports' own tests (a whole stack over NIXL: tests/runtime/test_serving.py -k nixl, 80 s more)
        ("kv_transport_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "tests/runtime/worker/test_kv_handoff.py"], None, 60),
        # the whole local stack on the GPUs: the same greedy text aggregated and disaggregated, the KV shared over
        # CUDA IPC with the prefill's answer
        ("stack_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/runtime/test_serving.py", "-k",
                         "same_greedy or really_ran"], None, 150),
        # a decode worker whose engine runs in a process of its own (the default on GPUs)
        ("engine_process_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "tests/runtime/worker/test_engine_process.py"], None, 120),
        ("kv_handoff_gpu0_to_1", [py, "benchmarks/kv_handoff.py", "--tokens", "2000", "--handoffs", "8",
                                  "--decode-device", "cuda:1", "--json", f"{scratch}/kv01.json"],
         f"{scratch}/kv01.json", 60),
        ("engine_sweeps", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--concurrency", "1,8,32,64",
                           "--output-tokens", "64"], None, 150),
        # the same without decode CUDA graphs (every step launched from Python)
        ("engine_sweeps_eager", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--concurrency", "1,8,32,64",
                                 "--output-tokens", "64", "--engine-args", '{"cuda_graph_config": null}'], None, 150),
        # the same step by step (every step's tokens read before the next is launched)
        ("engine_sweeps_no_overlap", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--concurrency",
                                      "1,8,32,64", "--output-tokens", "64", "--engine-args",
                                      '{"disable_overlap_scheduler": true}'], None, 150),
        # sustained load: output lengths 32-96, so every step admits a prompt or two beside its decode rows
        ("engine_spread", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--concurrency", "8,32,64",
                           "--output-tokens", "64", "--output-spread", "32"], None, 150),
        # the same with every prefill launched from Python
        ("engine_spread_eager_prefill", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--concurrency",
                                         "8,32,64", "--output-tokens", "64", "--output-spread", "32",
                                         "--engine-args", '{"torch_compile_config": null}'], None, 150),
        ("engine_8b", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--model", "llama-8b-shape",
                       "--concurrency", "1,8,32", "--output-tokens", "64"], None, 200),
        ("engine_8b_no_overlap", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--model",
                                  "llama-8b-shape", "--concurrency", "1,8,32", "--output-tokens", "64", "--engine-args",
                                  '{"disable_overlap_scheduler": true}'], None, 200),
        ("engine_8b_eager", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--model", "llama-8b-shape",
                             "--concurrency", "1,8,32", "--output-tokens", "64", "--engine-args",
                             '{"cuda_graph_config": null}'], None, 200),
        ("engine_8b_eager_prefill", [py, "benchmarks/e2e_throughput.py", "--engine-only", "--model",
                                     "llama-8b-shape", "--concurrency", "1,8,32", "--output-tokens", "64",
                                     "--engine-args", '{"torch_compile_config": null}'], None, 200),
        # decoding streams while long prompts arrive: prefilled whole, or in chunks between the decode steps
        ("chunked_prefill", [py, "benchmarks/chunked_prefill.py"], None, 90),
        ("chunked_prefill_8b", [py, "benchmarks/chunked_prefill.py", "--model", "llama-8b-shape", "--long-tokens",
                                "4096", "--budgets", "8192,1024"], None, 150),
        # TP, PP, EP (MoE) and TP-sharded MoE on two GPUs over NCCL: fp32 greedy tokens equal one rank's
        ("parallel_layouts_nccl", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                                   "tests/runtime/test_parallel_layouts.py"], None, 150),
        # the tiny video DiT on a GPU; with two GPUs its CFG and Ulysses ranks over NCCL equal one GPU (needs av)
        ("video_gpu", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                       "tests/runtime/test_video.py"], None, 150),
        # the whole local stack (etcd, NATS, frontend, workers): prefill and decode on their own GPUs
        ("stack_sweeps_disagg", [py, "benchmarks/stack_sweeps.py", "--recipe", "tiny-disagg", "--json",
                                 f"{scratch}/stack.json"] + profile, f"{scratch}/stack.json", 150),
        # the same with levels twice as long (c=64: about 4 s a sweep): first vs second beyond the noise
        ("stack_sweeps_disagg_long", [py, "benchmarks/stack_sweeps.py", "--recipe", "tiny-disagg",
                                      "--requests-per-user", "256"], None, 150),
        # levels of 16 requests a user, three rounds: a level of 4 a user lasted 0.1-0.4 s, and one hiccup moved
        # its figure by 10-30 %
        ("stack_vs_engine_agg", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-agg", "--concurrency",
                                 "1,8,32,64", "--rounds", "3", "--requests-per-user", "16", "--json",
                                 f"{scratch}/agg.json"], f"{scratch}/agg.json", 150),
        # the 8B shape (a call of their own, _goals.OWN_CALL): the hops against a 10 ms step, not the tiny model's
        # 0.1 ms; 256 in / 128 out, as in session 26. The stack's limits sized for them as the direct path's are
        # (512 tokens, not the recipe's 2,048): on one GPU the direct pair and the stack's are four 8B engines
        *[(f"stack_vs_engine_{kind}_8b", [py, "benchmarks/e2e_throughput.py", "--recipe", f"llama8b-{kind}",
                                          "--input-tokens", "256", "--output-tokens", "128", "--concurrency",
                                          "1,8,32,64", "--rounds", "2", "--set", "limits.max_input_tokens=320",
                                          "--set", "limits.max_output_tokens=192",
                                          "--json", f"{scratch}/{kind}_8b.json"],
           f"{scratch}/{kind}_8b.json", 290) for kind in ("agg", "disagg")],
        # what one 8B engine holds once ready, by mode: weights, KV, and its allocator's cache beyond them
        ("engine_memory_8b", [py, "benchmarks/engine_memory.py", "--json", f"{scratch}/memory.json"],
         f"{scratch}/memory.json", 150),
        # the direct path: the stack's own prefill and decode engines in one process (e2e_throughput --direct auto)
        ("stack_vs_engine_disagg", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-disagg",
                                    "--concurrency", "1,8,32,64", "--rounds", "3", "--requests-per-user", "16",
                                    "--json", f"{scratch}/disagg.json"], f"{scratch}/disagg.json", 150),
        # ... and against one aggregated engine (what disaggregation's own hop costs at this model's size)
        ("stack_vs_engine_disagg_vs_agg", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-disagg",
                                           "--concurrency", "1,8,32,64", "--rounds", "3", "--requests-per-user", "16",
                                           "--direct", "agg"], None, 150),
        # which of the VM's CPUs slow each other down (the host's placement of its vCPUs; sessions 16-18)
        ("cpu_siblings", [py, "benchmarks/cpu_siblings.py"], None, 60),
        # the engine's scheduler at c=64 by phase; a decode step's tokens to the host, events made or reused
        ("engine_steps", [py, "benchmarks/engine_steps.py", "--concurrency", "64"], None, 90),
        ("decode_host_copy", [py, "benchmarks/decode_host_copy.py"], None, 60),
        # one decode-graph replay by batch size on each path (GEMVs, batched matmuls), and which the engine kept
        ("decode_graph_paths", [py, "benchmarks/decode_graph_paths.py"], None, 90),
        # which kernels a decode graph's device time goes to, as the rows grow (session 22)
        ("decode_graph_kernels", [py, "benchmarks/decode_graph_kernels.py", "--sizes", "1,8,64"], None, 90),
        # a prefill step's host cost by part, the device idle (session 20); a prefill worker's engine by phase
        ("prefill_parts", [py, "benchmarks/prefill_parts.py", "--prompts", "1,4,8,16"], None, 90),
        ("engine_steps_prefill", [py, "benchmarks/engine_steps.py", "--role", "prefill", "--concurrency", "16"],
         None, 90),
        # the same with each worker's engine in the worker's process (on a GPU it has one of its own by default)
        ("stack_vs_engine_agg_in_worker", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-agg",
                                           "--concurrency", "1,8,32,64", "--rounds", "3", "--requests-per-user", "16",
                                           "--set", "runtime.engine_process=worker"], None, 150),
        ("stack_vs_engine_disagg_in_worker", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-disagg",
                                              "--concurrency", "1,8,32,64", "--rounds", "3", "--requests-per-user",
                                              "16", "--set", "runtime.engine_process=worker"], None, 150),
        ("stack_sweeps_disagg_long_in_worker", [py, "benchmarks/stack_sweeps.py", "--recipe", "tiny-disagg",
                                                "--requests-per-user", "256", "--set", "runtime.engine_process=worker"],
         None, 150),
        # the same through a frontend of one process (the default on this 16-core machine is two)
        ("stack_vs_engine_agg_1frontend", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-agg",
                                           "--concurrency", "1,8,32,64", "--rounds", "2",
                                           "--set", "frontend.processes=1"], None, 150),
        ("stack_vs_engine_disagg_1frontend", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-disagg",
                                              "--concurrency", "1,8,32,64", "--rounds", "2",
                                              "--set", "frontend.processes=1"], None, 150),
        ("stack_vs_engine_agg_spread", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-agg", "--concurrency",
                                        "8,32,64", "--rounds", "2", "--output-spread", "32"], None, 150),
        ("stack_vs_engine_disagg_spread", [py, "benchmarks/e2e_throughput.py", "--recipe", "tiny-disagg",
                                           "--concurrency", "8,32,64", "--rounds", "2", "--output-spread", "32"],
                                          None, 150),
    ]


def chosen(every: list[Step], only: str | None, run_all: bool) -> list[Step]:
    """The steps to run, in the order they run: the named ones (--only, in the suite's order), all (--all), or
    the goals' (DEFAULT_STEPS)."""
    if only:
        names = only.split(",")
        unknown = sorted(set(names) - {step[0] for step in every})
        if unknown:
            raise ValueError(f"--only names no step {', '.join(unknown)}; the steps: "
                             + ", ".join(step[0] for step in every))
        return [step for step in every if step[0] in names]
    if run_all:
        return every
    by_name = {step[0]: step for step in every}
    return [by_name[name] for name in DEFAULT_STEPS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_suite.json")
    parser.add_argument("--mpiexec", default="mpirun --allow-run-as-root")
    parser.add_argument("--budget", type=float, default=560.0, help="seconds for the whole suite")
    parser.add_argument("--only", help="comma-separated step names")
    parser.add_argument("--all", action="store_true", help="every step, not only the goals' (several calls' worth)")
    parser.add_argument("--profiles", help="where the stack's py-spy profiles go (with --all: a scratch directory "
                                           "unless given; otherwise none are taken unless given)")
    args = parser.parse_args()
    try:  # a name of no step is a usage error before torch loads or anything is made (the names need no GPU)
        chosen(steps(args.mpiexec, "", 1, None), args.only, args.all)
    except ValueError as exc:
        parser.error(str(exc))  # exit 2
    import torch

    deadline = time.monotonic() + args.budget
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
              "gpus": torch.cuda.device_count(), "torch": torch.__version__, "steps": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as scratch:
        profiles = args.profiles or (f"{scratch}/profile" if args.all else None)
        every = steps(args.mpiexec, scratch, max(1, min(2, report["gpus"])), profiles)
        for name, argv, json_file, limit in chosen(every, args.only, args.all):
            if name.endswith(("gpu0_to_1", "_nccl", "_tp2")) and torch.cuda.device_count() < 2:
                report["steps"][name] = {"status": "skipped: one GPU"}
                continue
            left = deadline - time.monotonic()
            if left < 10:
                report["steps"][name] = {"status": "skipped: out of time"}
                continue
            t0 = time.monotonic()
            try:
                done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=min(limit, left))
                status, output = ("ok" if done.returncode == 0 else f"failed (exit {done.returncode})"), \
                    done.stdout + done.stderr
            except subprocess.TimeoutExpired as exc:  # its output is bytes here whatever text= said
                status, output = "timed out", (exc.stdout or b"").decode(errors="replace")
            entry = {"status": status, "seconds": round(time.monotonic() - t0, 1),
                     "output_tail": "\n".join(output.strip().splitlines()[-25:])}
            if json_file and os.path.exists(json_file):
                with open(json_file) as handle:
                    entry["figures"] = json.load(handle)
            report["steps"][name] = entry
            print(f"--- {name}: {status} in {entry['seconds']} s\n{entry['output_tail']}\n", flush=True)
    found = verdicts(report["steps"])
    report["goals"] = [asdict(v) for v in found]
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    width = max(map(len, ["step", *report["steps"]]))
    print(f"{'step':<{width}} {'status':<22} {'seconds':>8}")
    for name, entry in report["steps"].items():
        print(f"{name:<{width}} {entry['status']:<22} {entry.get('seconds', '-'):>8}")
    print(f"\nissue #14's goals on {report['device']} x {report['gpus']}:\n{table(found)}\n")
    print(f"wrote {args.out} ({report['device']}, {report['gpus']} GPU(s), torch {report['torch']})")
    if any(not e["status"].startswith(("ok", "skipped: one GPU")) for e in report["steps"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
