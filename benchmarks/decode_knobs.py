"""Decode of the 8B shape under the fused kernels' knobs, variants in alternating rounds (needs CUDA).

    python benchmarks/decode_knobs.py [--rounds 3] [--steps 256] [--batch 1] [--json FILE]
    mpirun --allow-run-as-root -n 2 python benchmarks/decode_knobs.py      # TP=2, one rank per GPU

Each variant's step (with its greedy pick and next input, as gpu_check times it) is captured in a CUDA graph and
replayed; every round times every variant once, so a clock that drifts hits them all alike. Prints tok/s per
round, the median, and the share of the HBM roofline gpu_check uses (weights but the embedding table + 512
tokens of KV, over the measured copy bandwidth). Knobs (module constants, see KNOBS): whether the next kernel
launches as a GEMV starts rather than once its loads are issued (and whether before the peer all-reduce too),
cached positions per attention program and its warps, elements per peer all-reduce program; with `--batch` past
fused_decode.MAX_BATCH rows, the batched path's attention: positions a program, its tensor-core tiles, their warps and
pipeline stages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("HPC_GPU_CHECK_SHAPE", "8b")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import gpu_check  # noqa: E402
from hpc.runtime.engine.kernels import decode_kernels, fused_decode, peer_reduce  # noqa: E402
from hpc.runtime.engine.models.llama import TensorParallel  # noqa: E402
from hpc.runtime.engine.torch.tp import world_rank  # noqa: E402

KNOBS = {"early": (decode_kernels, "GEMV_EARLY_TRIGGER"), "chunk": (decode_kernels, "ATTN_CHUNK"),
         "chunk_batched": (decode_kernels, "ATTN_CHUNK_BATCHED"),
         "warps": (decode_kernels, "ATTN_WARPS"), "before_peer": (fused_decode, "EARLY_BEFORE_PEER_REDUCE"),
         "peer_block": (peer_reduce, "BLOCK"), "tile": (decode_kernels, "ATTN_TILE"),
         "tile_warps": (decode_kernels, "ATTN_WARPS_TILES"), "tile_stages": (decode_kernels, "ATTN_STAGES_TILES")}
NOW = {knob: getattr(module, attr) for knob, (module, attr) in KNOBS.items()}
VARIANTS = {  # name: the knobs it changes from what the code has now
    "now": {},
    "late trigger": {"early": False},
    "early trigger": {"early": True},
    "early, chunk 128": {"early": True, "chunk": 128},
    "early, chunk 128, 8 warps": {"early": True, "chunk": 128, "warps": 8},
    "early, chunk 256, 8 warps": {"early": True, "chunk": 256, "warps": 8},
    "late, chunk 128": {"early": False, "chunk": 128},
}
BATCHED_VARIANTS = {  # past fused_decode.MAX_BATCH rows: cuBLAS matmuls around the Triton attention
    "now": {},
    "group heads one by one, chunk 64": {"tile": 0, "chunk_batched": 64},
    "tiles of 64, chunk 64": {"tile": 64, "chunk_batched": 64},
    "tiles of 64, chunk 128": {"tile": 64, "chunk_batched": 128},
    "tiles of 128, chunk 256": {"tile": 128, "chunk_batched": 256},
    "tiles of 64, chunk 256, 3 stages": {"tile": 64, "chunk_batched": 256, "tile_stages": 3},
}
PEER_VARIANTS = {  # with TP over peer memory
    "late, peer 512": {"early": False, "peer_block": 512},
    "early, late before peer, peer 512": {"early": True, "before_peer": False, "peer_block": 512},
    "early all, peer 512": {"early": True, "before_peer": True, "peer_block": 512},
    "early, late before peer, 512, chunk 128": {"early": True, "before_peer": False, "peer_block": 512,
                                                "chunk": 128},
    "early, late before peer, peer 256": {"early": True, "before_peer": False, "peer_block": 256},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="rows per step (past 4: the batched variants)")
    parser.add_argument("--json")
    args = parser.parse_args()
    tp = gpu_check.join_mpi_ranks()[0] if world_rank()[1] > 1 else TensorParallel()
    rank, world = tp.rank, tp.size
    device = torch.device("cuda", torch.cuda.current_device())
    model = gpu_check.build(tp, device, torch.bfloat16, fused=True)
    bandwidth = gpu_check.copy_bandwidth(device)
    roof = gpu_check.roofline(bandwidth, gpu_check.weight_bytes(model), world)
    if args.batch > fused_decode.MAX_BATCH:
        variants = BATCHED_VARIANTS
    else:
        variants = {**VARIANTS, **(PEER_VARIANTS if model.fused_decode.peer is not None else {})}
    figures: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, changes in variants.items():
            for knob, value in {**NOW, **changes}.items():
                setattr(*KNOBS[knob], value)
            if world > 1:
                torch.distributed.barrier()
            figures[name].append(gpu_check.decode_speed(model, device, args.batch, steps=args.steps))
    if rank == 0:
        gpu = torch.cuda.get_device_name(device)
        print(f"8B shape, batch {args.batch}, TP={world} on {gpu}: copy {bandwidth / 1e9:.0f} GB/s, batch-1 roofline "
              f"{roof:.1f} tok/s (peer all-reduce: {model.fused_decode.peer is not None})")
        print(f"{'variant':42} {'rounds tok/s':>24} {'median':>8} {'of roof':>8}")
        for name, values in figures.items():
            median = statistics.median(values)
            share = f"{median / roof:8.1%}" if args.batch == 1 else f"{'-':>8}"  # the roofline is batch 1's
            print(f"{name:42} {' / '.join(f'{v:.1f}' for v in values):>24} {median:8.1f} {share}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"device": gpu, "tp": world, "copy_bandwidth": bandwidth, "roofline": roof, "now": NOW,
                           "batch": args.batch, "variants": variants, "tok_s": figures}, handle, indent=1)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
