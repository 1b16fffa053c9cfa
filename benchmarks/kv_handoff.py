"""KV handoff prefill -> decode on one node: CUDA IPC (device to device) against the bytes path (GPU -> host
bytes -> GPU, what crosses TCP), for an 8B-shaped model's KV of a 2,000-token prompt.

    python benchmarks/kv_handoff.py [--tokens 2000] [--handoffs 8]       # needs a CUDA GPU

A child process plays the prefill worker: it makes one fresh KV tensor per handoff on its GPU ([32 layers, 2,
8 KV heads, tokens, 128] bf16 = 262 MB at 2,000 tokens) and shares it with hpc.runtime.engine.kv.share; this
process plays the decode worker and times copy_shared (open the IPC handle, copy to its own GPU buffer,
synchronise) for each, checking the bytes arrived (a checksum the child computed). The bytes path times
kv.pack + kv.unpack + the upload in one process (the TCP transfer itself not counted: it only adds).
With two GPUs, `--decode-device cuda:1` copies GPU 0 -> 1 over the peer link.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import msgspec
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hpc.runtime.engine import kv as kvpack  # noqa: E402
from hpc.runtime.serve.wire import KvMeta  # noqa: E402

SHAPE = lambda tokens: [32, 2, 8, tokens, 128]  # noqa: E731  Llama-3.1-8B: 32 layers, 8 KV heads of 128


def prefill_side(tokens: int, handoffs: int) -> None:
    """Child: share `handoffs` fresh KV tensors, one msgpack line each (hex), keep them alive until stdin ends."""
    keep = []
    for i in range(handoffs):
        t = torch.randn(SHAPE(tokens), device="cuda:0", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        keep.append(t)
        line = msgspec.msgpack.encode([kvpack.share(t), float(t.float().sum())]).hex()
        print(line, flush=True)
    sys.stdin.read()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--handoffs", type=int, default=8)
    parser.add_argument("--decode-device", default="cuda:0")
    parser.add_argument("--prefill-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefill_side:
        prefill_side(args.tokens, args.handoffs)
        return
    child = subprocess.Popen([sys.executable, __file__, "--prefill-side", "--tokens", str(args.tokens),
                              "--handoffs", str(args.handoffs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    decoder = msgspec.msgpack.Decoder(tuple[KvMeta, float])
    ipc_ms, sizes, ok = [], 0, True
    torch.zeros(1, device=args.decode_device)  # the CUDA context exists before timing, as in a worker
    for _ in range(args.handoffs):
        meta, checksum = decoder.decode(bytes.fromhex(child.stdout.readline().strip()))
        t0 = time.perf_counter()
        kv = kvpack.copy_shared(meta, args.decode_device)
        ipc_ms.append((time.perf_counter() - t0) * 1e3)
        sizes = kv.numel() * kv.element_size()
        ok &= abs(float(kv.float().sum()) - checksum) <= 1e-3 * max(1.0, abs(checksum))
    child.stdin.close()
    child.wait(30)

    bytes_ms = []
    for _ in range(3):
        t = torch.randn(SHAPE(args.tokens), device="cuda:0", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        meta, data = kvpack.pack(t)
        back = kvpack.unpack(meta, data).to(args.decode_device)
        torch.cuda.synchronize()
        bytes_ms.append((time.perf_counter() - t0) * 1e3)
        ok &= torch.equal(back.cpu(), t.cpu())
    name = torch.cuda.get_device_name(0)
    print(f"KV handoff on {name}: {args.tokens} tokens of an 8B-shaped model ({sizes / 1e6:.0f} MB bf16), "
          f"prefill cuda:0 -> decode {args.decode_device}")
    print(f"{'path':<34} {'first ms':>9} {'median ms':>10} {'min ms':>8}")
    print(f"{'CUDA IPC, device to device':<34} {ipc_ms[0]:>9.2f} {statistics.median(ipc_ms[1:] or ipc_ms):>10.2f} "
          f"{min(ipc_ms):>8.2f}")
    print(f"{'bytes via host (TCP path, no net)':<34} {bytes_ms[0]:>9.2f} {statistics.median(bytes_ms):>10.2f} "
          f"{min(bytes_ms):>8.2f}")
    if not ok:
        sys.exit("KV handoff FAILED: the copied KV differs from the prefill side's")


if __name__ == "__main__":
    main()
