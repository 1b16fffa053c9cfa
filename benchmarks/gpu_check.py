"""GPU check: the torch reference engine's model on CUDA, TP=1 vs TP=2 over MPI + NCCL, decode speed vs roofline.

    python benchmarks/gpu_check.py [--shape 1b|8b] --mpiexec "mpirun --allow-run-as-root"

The TP=2 part needs 2 GPUs, mpi4py and the MPI mpi4py was built against (on the GPU machine its Open MPI
`mpirun --allow-run-as-root`; an MPICH `mpiexec` starts two singleton ranks of world size 1, which this check
refuses instead of comparing one record with itself). It builds a random-weight Llama — `1b`: hidden 2048,
16 layers, vocabulary 32k; `8b`: Llama-3.1-8B's shapes (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN
14336, vocabulary 128,256) — from a seeded CUDA generator (identical on every rank), then:
  1. greedy tokens for a fixed prompt set with TP=1, and with TP=2 launched as 2 MPI ranks (mpiexec),
     the process group initialised from the MPI ranks and each rank pinned to its own GPU;
     compared in fp32 (bf16 agreement is reported too);
  2. decode tokens/s at batch 1, 8 and 64 in bf16 (a token's step, greedy pick and next input captured in a
     CUDA graph, as the engine's decode graphs hold them), and batch 1
     against the HBM roofline: bytes read per token (weights + KV) / measured device copy bandwidth.
     Every batch runs the engine's decode path: batch 1 the fused Triton kernels (five per layer), batch 8
     and 64 cuBLAS matmuls around the Triton decode attention; batch 8 and 64 are also timed on the torch
     path compiled by inductor (SDPA attention). `--torch-b1` also times batch 1 on the compiled torch path.
     With TP=2 the fused path's all-reduces go over peer memory (`peer_reduce`) where the GPUs reach each
     other; batch 1 is then timed through NCCL's all-reduce too, and its bf16 greedy tokens must be the same.
Prints one table; `--json PATH` also writes the figures; `--profile` adds the batch-1 kernel times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hpc.runtime.engine.models.llama import (LlamaConfig, LlamaForCausalLM, TensorParallel, random_state,  # noqa: E402
                                      shard_state_dict)
from hpc.runtime.engine.torch.tp import init_group, world_rank  # noqa: E402

SHAPES = {
    "1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096),
    "8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0),
}
CFG = SHAPES[os.environ.get("HPC_GPU_CHECK_SHAPE", "1b")]  # the MPI ranks read the choice from the environment
PROMPTS = [[1, 15043, 29892, 590, 1024, 338], [1, 450, 7483, 310, 3444, 338], [1, 822, 1667, 7295],
           [1, 3532, 833, 4909, 310, 278, 21589, 29871], [1, 29871, 29896, 29974, 29896, 29922]]
GREEDY_TOKENS = 32
SEED = 1234
COMPILE = os.environ.get("HPC_GPU_CHECK_COMPILE", "1") == "1"


def full_state(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return random_state(CFG, device, dtype, SEED)


def build(tp: TensorParallel, device: torch.device, dtype: torch.dtype, fused: bool) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(CFG, tp)
    model.load_state_dict(shard_state_dict(full_state(device, dtype), tp), assign=True)
    model = model.to(device).eval().fuse_projections()
    return model.enable_fused_decode() if fused else model


@torch.inference_mode()
def greedy(model: LlamaForCausalLM, device: torch.device,
           dtype: torch.dtype) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens per prompt, and at each step the gap between the two highest logits."""
    out, gaps = [], []
    for prompt in PROMPTS:
        cache = model.new_cache(1, 256, dtype, device)
        slots = torch.zeros(1, dtype=torch.long, device=device)
        ids = torch.tensor([prompt], device=device)
        logits = model.forward_step(model.embed(ids), torch.arange(len(prompt), device=device)[None], slots, cache)
        tokens, margins = [], []
        for i in range(GREEDY_TOKENS):
            top = logits[0].topk(2).values
            tokens.append(int(logits[0].argmax()))
            margins.append(float(top[0] - top[1]))
            if i == GREEDY_TOKENS - 1:
                break
            pos = torch.tensor([[len(prompt) + i]], device=device)
            logits = model.forward_step(model.embed(torch.tensor([[tokens[-1]]], device=device)), pos, slots, cache)
        out.append(tokens)
        gaps.append(margins)
    return out, gaps


@torch.inference_mode()
def decode_speed(model: LlamaForCausalLM, device: torch.device, batch: int, context: int = 512,
                 steps: int = 64) -> float:
    """Tokens/s of batched decode at `context` tokens of KV, the step replayed from a CUDA graph."""
    dtype = torch.bfloat16
    window = context + steps + 1
    cache = model.new_cache(batch, window, dtype, device)
    slots = torch.arange(batch, device=device)
    tokens = torch.randint(100, 30000, (batch, 1), device=device)
    positions = torch.full((batch, 1), context, device=device)
    embeds = model.embed(tokens)

    forward = model.forward_step
    # compile the undecorated method (we already run under inference_mode); the fused path is Triton already
    if COMPILE and not model.takes_fused_path(embeds):
        raw = type(model).forward_step.__wrapped__
        forward = torch.compile(lambda *a, **k: raw(model, *a, **k), dynamic=False)

    def step() -> torch.Tensor:  # inductor fuses the small element-wise kernels; the graph removes launches
        return forward(embeds, positions, slots, cache, window=window, contiguous_slots=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(5):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a whole token, as the engine's decode graphs take it (they pick in the graph):
        logits = step()  # the step, its greedy pick, the pick's embedding as the next input, the next position
        embeds.copy_(model.embed(logits.argmax(-1, keepdim=True)))
        positions.add_(1)
    for _ in range(5):
        graph.replay()
    positions.fill_(context)  # the warm replays moved on; the timed ones start at `context` again
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def copy_bandwidth(device: torch.device, best_of: int = 1) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once); the best of `best_of` timings
    (one timing varied from 2.7 to 4.3 TB/s within a call on an H200)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    reps, best = 20, 0.0
    for _ in range(best_of):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        torch.cuda.synchronize()
        best = max(best, 2 * n * reps / (time.perf_counter() - t0))
    return best


def weight_bytes(model: LlamaForCausalLM) -> int:
    # embeddings are looked up (one row), not streamed; every other weight is read once per step
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


@torch.inference_mode()
def profile_step(model: LlamaForCausalLM, device: torch.device, context: int = 512) -> list[tuple[str, int, float]]:
    """(kernel, launches per token, µs per token) of batch-1 fused decode steps, longest first."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache(1, context + 64, torch.bfloat16, device)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    embeds = model.embed(torch.tensor([[1000]], device=device))
    positions = torch.full((1, 1), context, device=device)
    for _ in range(3):
        model.forward_step(embeds, positions, slots, cache)
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model.forward_step(embeds, positions, slots, cache)
        torch.cuda.synchronize()
    rows = [(e.key[:60], e.count // steps, e.device_time_total / steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])


def join_mpi_ranks():
    """This MPI rank on its own GPU (the launcher's local rank) and the TP group of every rank, NCCL set up from
    MPI: (TensorParallel, the MPI communicator)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.cuda.set_device(world_rank()[2] % torch.cuda.device_count())
    master = comm.bcast(f"127.0.0.1:{29500 + os.getpid() % 1000}" if rank == 0 else None, root=0)
    return init_group(rank, world, master, torch.device("cuda", torch.cuda.current_device())), comm


def roofline(bandwidth: float, weight_bytes_per_rank: int, ranks: int, context: int = 512) -> float:
    """Tokens/s of batch-1 decode if it only streamed its bytes at copy speed: each rank's weights and its share
    of `context` tokens of bf16 KV."""
    kv = 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * CFG.head_dim * 2 * context
    return bandwidth / (weight_bytes_per_rank + kv / ranks)


def run_rank(tp_size: int, out_path: str) -> None:
    """One rank: TP=1 in this process, or rank r of TP=2 started by mpiexec."""
    tp, comm = join_mpi_ranks() if tp_size > 1 else (TensorParallel(), None)
    rank, world = tp.rank, tp.size
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    result = {"rank": rank, "world": world, "gpu": torch.cuda.current_device(), "name": props.name,
              "uuid": str(getattr(props, "uuid", "")), "pci_bus": getattr(props, "pci_bus_id", None)}
    fp32 = build(tp, device, torch.float32, fused=False)  # the reference path, where rounding is smallest
    result["greedy_fp32"], result["gaps_fp32"] = greedy(fp32, device, torch.float32)
    del fp32
    torch.cuda.empty_cache()
    bf16 = build(tp, device, torch.bfloat16, fused=True)
    result["greedy_bf16"], result["gaps_bf16"] = greedy(bf16, device, torch.bfloat16)
    result["params"] = sum(p.numel() for p in bf16.parameters()) * world
    result["weight_bytes_per_rank"] = weight_bytes(bf16)
    result["decode_tps"] = {b: decode_speed(bf16, device, b) for b in (1, 8, 64)}
    peer = bf16.fused_decode.peer
    result["peer_reduce"] = peer is not None
    if peer is not None:  # the same steps with NCCL's all-reduce: the same tokens, and how much slower
        bf16.fused_decode.peer = None
        result["greedy_bf16_nccl"] = greedy(bf16, device, torch.bfloat16)[0]
        result["decode_tps_b1_nccl"] = decode_speed(bf16, device, 1)
        bf16.fused_decode.peer = peer
    if os.environ.get("HPC_GPU_CHECK_TORCH_PATH", "1") == "1":
        # the engine's batched decode (cuBLAS matmuls + Triton attention) against the compiled torch path (SDPA);
        # its compiles took two of gpu_check's four minutes for the 8B shape on a fresh machine
        fused, bf16.fused_decode = bf16.fused_decode, None
        result["decode_tps_torch"] = {b: decode_speed(bf16, device, b) for b in (8, 64)}
        bf16.fused_decode = fused
    if os.environ.get("HPC_GPU_CHECK_PROFILE") == "1":
        result["profile_b1"] = profile_step(bf16, device)
        from hpc.runtime.engine.kernels.decode_kernels import tuned_configs

        result["tuned"] = tuned_configs()
    if os.environ.get("HPC_GPU_CHECK_TORCH_B1") == "1":
        bf16.fused_decode = None
        result["decode_tps_torch_b1"] = decode_speed(bf16, device, 1)
    result["copy_bandwidth"] = copy_bandwidth(device)
    if tp_size > 1:
        gathered = comm.gather(result, root=0)
        if rank == 0:
            with open(out_path, "w") as handle:
                json.dump(gathered, handle)
        torch.distributed.destroy_process_group()
    else:
        with open(out_path, "w") as handle:
            json.dump([result], handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--mpiexec", default="mpiexec", help='the MPI launcher, e.g. "mpirun --allow-run-as-root"')
    parser.add_argument("--shape", choices=sorted(SHAPES), default=os.environ.get("HPC_GPU_CHECK_SHAPE", "1b"))
    parser.add_argument("--profile", action="store_true", help="print batch-1 kernel times (fused path)")
    parser.add_argument("--torch-b1", action="store_true", help="also time batch 1 on the compiled torch path")
    parser.add_argument("--no-torch-path", action="store_true",
                        help="skip the compiled torch path's batch 8 and 64 (a comparison; its compiles are slow)")
    args = parser.parse_args()
    # the MPI ranks are separate processes: the choices travel in their environment
    os.environ["HPC_GPU_CHECK_PROFILE"] = "1" if args.profile else os.environ.get("HPC_GPU_CHECK_PROFILE", "0")
    os.environ["HPC_GPU_CHECK_TORCH_B1"] = "1" if args.torch_b1 else os.environ.get("HPC_GPU_CHECK_TORCH_B1", "0")
    os.environ["HPC_GPU_CHECK_SHAPE"] = args.shape
    if args.no_torch_path:
        os.environ["HPC_GPU_CHECK_TORCH_PATH"] = "0"
    global CFG
    CFG = SHAPES[args.shape]
    if args.rank_of:
        run_rank(args.rank_of, args.out)
        return
    tmp = tempfile.mkdtemp(prefix="gpu-check-")
    run_rank(1, f"{tmp}/tp1.json")
    tp1 = json.load(open(f"{tmp}/tp1.json"))[0]
    tp2 = None
    result_ok = True
    if torch.cuda.device_count() >= 2:
        cmd = [*args.mpiexec.split(), "-n", "2", sys.executable, __file__, "--rank-of", "2", "--out",
               f"{tmp}/tp2.json"]
        subprocess.run(cmd, check=True)
        tp2 = json.load(open(f"{tmp}/tp2.json"))
        worlds = sorted(r["world"] for r in tp2)
        if worlds != [2, 2]:
            sys.exit(f"GPU check FAILED: `{args.mpiexec} -n 2` gave ranks of world size {worlds}, not two ranks of "
                     "one world of 2: the launcher is not the MPI mpi4py was built against (use its mpirun)")
    rows = []
    summary: dict = {"b1_of_roofline": {}}  # what gpu_suite's goals read (_goals.py)
    for label, ranks in (("TP=1", [tp1]), ("TP=2", tp2)):
        if not ranks:
            continue
        r0 = ranks[0]
        bw = min(r["copy_bandwidth"] for r in ranks)
        roof = roofline(bw, r0["weight_bytes_per_rank"], len(ranks))
        rows.append((label, r0["decode_tps"], roof, bw))
        summary["b1_of_roofline"][label] = r0["decode_tps"]["1"] / roof
    print(f"GPU check on {tp1['name']}: {tp1['params'] / 1e9:.2f} B parameters, bf16 decode, KV context 512")
    print("ranks: " + "; ".join(f"TP=2 rank {r['rank']} -> cuda:{r['gpu']} {r['uuid'] or r['pci_bus']}"
                                for r in (tp2 or [])))
    if tp2:
        same32 = tp2[0]["greedy_fp32"] == tp1["greedy_fp32"]
        distinct = len({(r["uuid"], r["pci_bus"]) for r in tp2}) == len(tp2)
        same16 = sum(a == b for a, b in zip(tp2[0]["greedy_bf16"], tp1["greedy_bf16"]))
        # fp32 is the exact check of the tensor-parallel math; in bf16 the two sum in different orders and
        # round differently, which flips a greedy pick only where two logits (nearly) tie: show those gaps
        result_ok = same32 and distinct
        summary.update(tp2_fp32_same_as_tp1=same32, tp2_distinct_gpus=distinct)
        print(f"greedy tokens TP=2 == TP=1 (fp32, {len(PROMPTS)} prompts x {GREEDY_TOKENS}): {same32}; "
              f"distinct GPUs per rank: {distinct}")
        split = []
        for a, b, gaps in zip(tp1["greedy_bf16"], tp2[0]["greedy_bf16"], tp1["gaps_bf16"]):
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first is not None:
                split.append(f"token {first} (top-2 logit gap {gaps[first]:.3f})")
        all_gaps = sorted(g for gaps in tp1["gaps_bf16"] for g in gaps)
        print(f"bf16: {same16}/{len(PROMPTS)} prompts identical; the others part at " + ("; ".join(split) or "-")
              + f"; median top-2 gap over all steps {all_gaps[len(all_gaps) // 2]:.3f}")
        if tp2[0]["peer_reduce"]:
            # the same sums in the same order as NCCL's: the same bits, so the same tokens
            same_reduce = all(r["greedy_bf16"] == r["greedy_bf16_nccl"] for r in tp2)
            result_ok = result_ok and same_reduce
            print(f"TP=2 all-reduce over peer memory: bf16 greedy tokens == NCCL's: {same_reduce}; batch 1 "
                  f"{tp2[0]['decode_tps']['1']:.1f} tok/s vs {tp2[0]['decode_tps_b1_nccl']:.1f} through NCCL")
        else:
            print("TP=2 all-reduce: NCCL (peer memory not available between these GPUs)")
    print(f"{'':6} {'b=1 tok/s':>10} {'b=8 tok/s':>10} {'b=64 tok/s':>11} {'b=1 roofline':>13} {'b=1 / roof':>10} "
          f"{'copy GB/s':>10}")
    for label, tps, roof, bw in rows:
        print(f"{label:6} {tps['1']:>10.1f} {tps['8']:>10.1f} {tps['64']:>11.1f} {roof:>13.1f} "
              f"{tps['1'] / roof:>10.0%} {bw / 1e9:>10.0f}")
    for label, ranks in (("TP=1", [tp1]), ("TP=2", tp2)):
        if ranks and "decode_tps_torch" in ranks[0]:
            t = ranks[0]["decode_tps_torch"]
            print(f"{label} b=8 / b=64 on the compiled torch path (SDPA) instead: {t['8']:.1f} / {t['64']:.1f} tok/s")
        if ranks and "decode_tps_torch_b1" in ranks[0]:
            print(f"{label} batch 1 on the compiled torch path: {ranks[0]['decode_tps_torch_b1']:.1f} tok/s")
        if ranks and "profile_b1" in ranks[0]:
            print(f"{label} rank 0, batch-1 fused step, GPU time per token by kernel:")
            for name, count, micros in ranks[0]["profile_b1"][:12]:
                print(f"  {micros:8.1f} µs {count:5d}x  {name}")
            total = sum(r[2] for r in ranks[0]["profile_b1"])
            print(f"  {total:8.1f} µs in {sum(r[1] for r in ranks[0]['profile_b1'])} launches")
            for key, config in ranks[0].get("tuned", {}).items():
                print(f"  tuned {key}: {config}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tp1": tp1, "tp2": tp2, "summary": summary}, handle, indent=1)
    if not result_ok:
        sys.exit("GPU check FAILED: fp32 TP=2 tokens differ from TP=1, two ranks share a GPU, or the all-reduce "
                 "over peer memory gave other tokens than NCCL's")


if __name__ == "__main__":
    main()
