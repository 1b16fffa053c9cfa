"""The fused decode kernels one by one, against torch's own ops: time and bandwidth per shape (needs CUDA).

    python benchmarks/decode_kernels.py

Shapes of the 1 B-parameter GPU-check model (hidden 2048, 16 heads / 8 KV heads, MLP 5632, vocabulary 32k),
batch 1, bf16. Each kernel is timed alone (triton.testing.do_bench, median, L2 flushed between runs);
bandwidth counts the weight bytes (and KV bytes for attention) once.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HPC_PDL", "0")  # alone, a kernel launched early would time its wait on the L2 flush

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hpc.runtime.engine.kernels import decode_kernels as dk  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, CONTEXT = 2048, 16, 8, 128, 5632, 32000, 512


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    bandwidth = copy_bandwidth()
    rows = []
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    norm = torch.rand(HIDDEN, device=dev, dtype=dt) + 0.5
    for name, n, k, kwargs in (("qkv (+norm)", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, {"norm": norm}),
                               ("o (+residual)", HIDDEN, HIDDEN, {"residual": x}),
                               ("gate/up (+norm)", 2 * MLP, HIDDEN, {"norm": norm}),
                               ("down (+act, +residual)", HIDDEN, MLP, {"silu_mul": True, "residual": x}),
                               ("lm_head (+norm)", VOCAB, HIDDEN, {"norm": norm, "out_dtype": torch.float32})):
        weight = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
        inp = torch.randn(1, 2 * k if kwargs.get("silu_mul") else k, device=dev, dtype=dt)
        ours = do_bench(lambda: dk.gemv(inp, weight, **kwargs), return_mode="median") * 1e3
        plain = inp[:, :k].contiguous()
        theirs = do_bench(lambda: F.linear(plain, weight), return_mode="median") * 1e3
        rows.append((name, weight.numel() * 2, ours, theirs))
    cache = torch.randn(2, 1, KV_HEADS, CONTEXT + 64, HEAD_DIM, device=dev, dtype=dt)
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=dt)
    cos, sin = torch.randn(CONTEXT + 64, HEAD_DIM, device=dev), torch.randn(CONTEXT + 64, HEAD_DIM, device=dev)
    slots, pos = torch.zeros(1, dtype=torch.long, device=dev), torch.full((1,), CONTEXT, device=dev)
    ours = do_bench(lambda: dk.decode_attention(qkv, cache[0], cache[1], slots, pos, cos, sin, HEADS, KV_HEADS),
                    return_mode="median") * 1e3
    q = torch.randn(1, HEADS, 1, HEAD_DIM, device=dev, dtype=dt)
    keys, values = cache[0, :, :, :CONTEXT], cache[1, :, :, :CONTEXT]
    theirs = do_bench(lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True),
                      return_mode="median") * 1e3
    rows.append((f"attention (ctx {CONTEXT}, +rope, +kv write)", 2 * KV_HEADS * CONTEXT * HEAD_DIM * 2, ours, theirs))
    print(f"decode kernels, batch 1, bf16, on {torch.cuda.get_device_name()}; copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s")
    print(f"{'kernel':38} {'MB':>6} {'ours µs':>8} {'% copy bw':>9} {'torch µs':>9} {'% copy bw':>9}")
    for name, size, ours, theirs in rows:
        print(f"{name:38} {size / 1e6:>6.1f} {ours:>8.1f} {size / (ours * 1e-6) / bandwidth:>9.0%} "
              f"{theirs:>9.1f} {size / (theirs * 1e-6) / bandwidth:>9.0%}")


if __name__ == "__main__":
    main()
