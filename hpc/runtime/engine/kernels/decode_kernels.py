"""Fused Triton kernels for small-batch decode: five launches per layer instead of dozens.

Batch-1 decode is bound by how fast the weights stream from memory, and by how many kernels each
token pays a launch-and-drain gap for. These kernels fold the element-wise work into the matmuls:

- `gemv`: y = W·x for a few rows of x, with an optional RMSNorm prologue (the row's sum of squares is
  accumulated in the same pass over K, so the norm costs no extra read), an optional SiLU(gate)·up
  prologue (the MLP's activation) and an optional residual epilogue;
- `decode_attention`: RoPE on q and k, the new K/V written into the cache slot, and attention over the
  cached positions split into chunks of `ATTN_CHUNK` (one program per query head and chunk, so a single
  token's attention still spreads over the whole GPU; past a few rows one program per KV head's query group and
  chunk, which reads its K/V once for the group in tensor-core tiles); the last chunk of each head (or group) to
  finish merges them;
- `add_rms_norm` and `silu_mul`: the batched path's element-wise work between its cuBLAS matmuls, one launch each.

Per layer: norm+qkv, rope+kv-write+attention(+merge), o+residual, norm+gate/up, act+down+residual.
On Hopper and later the kernels use programmatic dependent launch: each one is launched while the
previous runs (once all of the previous one's programs have started), starts loading its weights, and waits
(`gdc_wait`) only before reading what the previous kernel wrote.
Accumulation is fp32 throughout; inputs and weights keep their dtype. Imported only where Triton is
(CUDA machines; the tests run the same kernels on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda  # programmatic dependent launch (gdc_wait, ...)

from hpc.runtime.engine.kernels.launch import launch

# Block sizes and warps tried the first time each shape runs (before CUDA-graph capture).
# A BLOCK_K as wide as K lets a program fetch all its weights before it waits on the previous kernel.
# The wide tiles (32-64 columns of a 128-256 slice) are for many rows of a small model: a program a row and 2-4
# columns there made 131k programs of a 4,096-token vocabulary at 64 rows, each too little work for its launch.
_GEMV_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=stages)
                 for n, k, w in ((4, 512, 4), (8, 256, 4), (2, 1024, 4), (4, 1024, 4), (1, 2048, 4), (2, 2048, 4),
                                 (4, 2048, 8), (8, 1024, 8), (8, 512, 4), (16, 256, 4), (16, 512, 8),
                                 (32, 128, 4), (64, 128, 4), (32, 256, 8))
                 for stages in (3, 4)]
# Rows a GEMV is tuned for, by class: the best tile for one row is not the best for 64 (they took 81 µs of a
# 64-row step on one machine and 124 on another with the one-row tile). Each class tunes at its first eager
# call, which a decode graph's capture makes before it captures (DecodeGraphs.capture).
GEMV_ROW_CLASSES = (1, 16, 64)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if _INTERPRET:  # the CPU interpreter has nothing to time: one config
    _GEMV_CONFIGS = _GEMV_CONFIGS[2:3]  # (8, 256, 4), 3 stages
# Measured on two H200 with the 8B shape at batch 1 (benchmarks/decode_knobs.py, docs/performance-log.md): chunks of
# 128 with the early trigger, 244.9 tok/s at TP=1 against 239.3 with chunks of 64 and the trigger after the loads
ATTN_CHUNK = 128  # cached positions per attention program
# Past the GEMVs' few rows (fused_decode.MAX_BATCH), where programs are many anyway: a program per KV head's query
# group (decode_attention's `grouped`) and chunks of 256 positions in tensor-core tiles of 64 (ATTN_TILE). The 8B
# shape, one H200 (benchmarks/decode_knobs.py --batch 64 / 32): 7,530 / 4,218 tok/s, against 7,233 / 4,104 with
# chunks of 64 and 5,552 / 3,385 with the group's heads one by one; tiles of 32 or 128, or 8 warps, were slower at 64.
ATTN_CHUNK_BATCHED = 256
ATTN_GROUPED_BATCHED = True
# The warps of a grouped program without tiles (ATTN_TILE 0). The 8B shape at 64 rows, chunks of 64, one H200
# (benchmarks/decode_profile.py): 2 warps 5,415 tok/s, 4 warps 4,646, 8 warps 3,084.
ATTN_WARPS_BATCHED = 2
ATTN_WARPS = 4  # 8 with chunks of 128: 240.1
# The grouped programs' tensor-core tiles: positions a dot takes (0: the group's heads one by one, the 2-warp
# programs above), the warps and the software pipeline's stages over a chunk's tiles.
ATTN_TILE = 64
ATTN_WARPS_TILES = 4
ATTN_STAGES_TILES = 2
# The next kernel may launch as soon as every program of a GEMV has started, not once each has issued its last
# loads: its programs take the SMs the GEMV's last wave leaves and fetch their first weights during its tail.
GEMV_EARLY_TRIGGER = True


@functools.cache  # asked at every launch of the decode hot path
def _use_pdl(device: torch.device) -> bool:
    return (not _INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and os.environ.get("HPC_PDL", "1") == "1")


@triton.jit
def _gemv_block(acc, squares, x_row, norm_ptr, k0, K, w,
                HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_K slice: acc += w * prologue(x); w is this slice's weight tile, already loaded."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    if SILU_MUL:  # x holds [gate | up] of width 2K
        gate = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + ks, mask=k_mask, other=0.0).to(tl.float32)
        x = gate * tl.sigmoid(gate) * up
    else:
        x = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # the sum of squares rides along; the norm's scale is applied to the dot product at the end
        squares += x * x
        x = x * tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    return acc + w.to(tl.float32) * x[None, :], squares


@triton.jit
def _weight_tile(w_ptr, cols_n, n_mask, k0, K, BLOCK_K: tl.constexpr):
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + cols_n[:, None] * K + ks[None, :], mask=n_mask[:, None] & (ks < K)[None, :], other=0.0)


def row_class(rows: int) -> int:
    """The smallest row class that holds `rows` (the largest past them all): what the GEMVs' tuning keys on."""
    return next((c for c in GEMV_ROW_CLASSES if rows <= c), GEMV_ROW_CLASSES[-1])


def _quick_bench(kernel_call, quantiles):
    """Triton's default times each config for 25 + 100 ms: 22 configs for each of a model's five matmul shapes
    made 14 s of every engine's warm-up. A GEMV runs for microseconds, so 20 ms is still thousands of runs."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# the tuned configs kept on disk (Triton's cache) where this Triton can: a relaunch on the node tunes nothing
_CACHE_RESULTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


@triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "HAS_NORM", "SILU_MUL", "ROW_CLASS"], do_bench=_quick_bench,
                 **_CACHE_RESULTS)
@triton.jit(do_not_specialize=["ROW_CLASS"])  # a key for the tuning only: one compiled kernel for every class
def _gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, norm_ptr, N, K, stride_x, stride_out, eps, ROW_CLASS,
                 HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
                 EARLY_TRIGGER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One flat grid, batch row fastest: programs reading the same weight tile run together. (Not a 2-D grid:
    # its second axis stops at 65,535 blocks, fewer than a 128k vocabulary's tiles at small BLOCK_N.)
    rows = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    row = tl.program_id(0) % rows
    cols_n = (tl.program_id(0) // rows) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    x_row = x_ptr + row * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    if USE_PDL and EARLY_TRIGGER:
        tl_cuda.gdc_launch_dependents()
    first = _weight_tile(w_ptr, cols_n, n_mask, 0, K, BLOCK_K)  # weights never change: load before waiting
    if USE_PDL:
        tl_cuda.gdc_wait()
    acc, squares = _gemv_block(acc, squares, x_row, norm_ptr, 0, K, first, HAS_NORM, SILU_MUL, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _weight_tile(w_ptr, cols_n, n_mask, k0, K, BLOCK_K)
        acc, squares = _gemv_block(acc, squares, x_row, norm_ptr, k0, K, w, HAS_NORM, SILU_MUL, BLOCK_K)
    if USE_PDL and not EARLY_TRIGGER:
        tl_cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if HAS_NORM:
        y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    if HAS_RES:
        y += tl.load(res_ptr + row * stride_out + cols_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def tuned_configs() -> dict[str, str]:
    """What autotuning chose, per kernel and key (for benchmark reports)."""
    return {f"gemv{key[:5]}": str(config) for key, config in _gemv_kernel.cache.items()}


def gemv(x: torch.Tensor, weight: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 1e-5,
         silu_mul: bool = False, residual: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
         early_trigger: bool | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with silu_mul) times weight [N, K]ᵀ -> [M, N]; M is small (decode).
    `out`: where to write it (contiguous [M, N]; its dtype wins over out_dtype). `early_trigger`: whether the next
    kernel may launch as soon as this one's programs start (default GEMV_EARLY_TRIGGER)."""
    rows = x.shape[0]
    n, k = weight.shape
    assert x.is_contiguous() and weight.is_contiguous() and x.shape[1] == (2 * k if silu_mul else k)
    if out is None:
        out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (rows, n) and out.is_contiguous()
    if residual is not None:
        assert residual.shape == out.shape and residual.is_contiguous()
    grid = lambda meta: (rows * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    pdl = _use_pdl(x.device)
    launch(_gemv_kernel, grid)(x, weight, out, residual if residual is not None else out,
                       norm if norm is not None else weight, n, k, x.stride(0), out.stride(0), eps, row_class(rows),
                       HAS_NORM=norm is not None, SILU_MUL=silu_mul, HAS_RES=residual is not None,
                       USE_PDL=pdl, launch_pdl=pdl,
                       EARLY_TRIGGER=GEMV_EARLY_TRIGGER if early_trigger is None else early_trigger)
    return out


@triton.jit
def _rope(at, d, rotated, sign, cos, sin):
    return tl.load(at + d).to(tl.float32) * cos + sign * tl.load(at + rotated).to(tl.float32) * sin


@triton.jit
def _attention_chunk_kernel(qkv_ptr, k_cache, v_cache, part_acc, part_stat, slots_ptr, pos_ptr, cos_ptr, sin_ptr,
                            counts_ptr, out_ptr, stride_qkv, stride_slot, stride_head, stride_pos, scale, chunks,
                            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr, MERGE: tl.constexpr,
                            GROUPED: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, head, chunk): softmax statistics and weighted values over one chunk of positions; GROUPED,
    program (row, kv head, chunk) for every query head of the KV head's group, which then read its cached K/V
    once instead of once per query head (at 64 rows the ungrouped reads were 4x the KV, and the step's largest
    kernel).

    Chunk 0 also takes the new token (from registers) and its head-group leader writes the new K/V into
    the cache; other chunks read only positions before it, so nothing reads what this launch writes.
    With MERGE the last of a head's (or group's) chunks to finish (an arrival count per row and program, which it
    sets back to 0) merges them all and writes the output: no merge kernel, one launch and one wait fewer.
    """
    row = tl.program_id(0)
    which = tl.program_id(1)
    chunk = tl.program_id(2)
    group: tl.constexpr = HEADS // KV_HEADS
    kv_head = which if GROUPED else which // group
    if USE_PDL:  # one wave of small programs: let the merge kernel take its place at once
        tl_cuda.gdc_launch_dependents()
    # Positions, slots, the RoPE tables and the cached K/V are not written by the kernel before this one
    # (the q/k/v matmul): they load while it drains; only q/k/v wait for it.
    pos = tl.load(pos_ptr + row)
    if chunk == 0 or chunk * CHUNK < pos:
        slot = tl.load(slots_ptr + row)
        d = tl.arange(0, HEAD_DIM)
        cache_row = slot * stride_slot + kv_head * stride_head
        ls = chunk * CHUNK + tl.arange(0, CHUNK)
        l_mask = ls < pos
        offsets = cache_row + ls[:, None] * stride_pos + d[None, :]
        keys = tl.load(k_cache + offsets, mask=l_mask[:, None], other=0.0).to(tl.float32)
        values = tl.load(v_cache + offsets, mask=l_mask[:, None], other=0.0).to(tl.float32)
        half: tl.constexpr = HEAD_DIM // 2
        rotated = (d + half) % HEAD_DIM  # rotate_half: [-x2, x1]
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * HEAD_DIM + d)
        sin = tl.load(sin_ptr + pos * HEAD_DIM + d)
        if USE_PDL:
            tl_cuda.gdc_wait()
        base = qkv_ptr + row * stride_qkv
        first = kv_head * group if GROUPED else which
        if chunk == 0:  # the new token joins chunk 0, as the cache will keep it
            k_new = _rope(base + (HEADS + kv_head) * HEAD_DIM, d, rotated, sign, cos, sin).to(k_cache.dtype.element_ty)
            v_new = tl.load(base + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + d)
            if GROUPED or which % group == 0:
                tl.store(k_cache + cache_row + pos * stride_pos + d, k_new)
                tl.store(v_cache + cache_row + pos * stride_pos + d, v_new.to(v_cache.dtype.element_ty))
            for g in tl.static_range(group if GROUPED else 1):  # pyright: ignore[reportGeneralTypeIssues]
                _head_partial(base, first + g, keys, values, l_mask, d, rotated, sign, cos, sin, scale,
                              k_new.to(tl.float32), v_new.to(tl.float32), part_acc, part_stat,
                              (row * HEADS + first + g) * chunks + chunk, HEAD_DIM, tl.constexpr(True))
        else:
            for g in tl.static_range(group if GROUPED else 1):  # pyright: ignore[reportGeneralTypeIssues]
                _head_partial(base, first + g, keys, values, l_mask, d, rotated, sign, cos, sin, scale, cos, cos,
                              part_acc, part_stat, (row * HEADS + first + g) * chunks + chunk, HEAD_DIM,
                              tl.constexpr(False))
        if MERGE:
            tl.debug_barrier()  # every thread's stores are issued before the count says this chunk is done
            used = tl.maximum(tl.cdiv(pos, CHUNK), 1)  # the chunks that take part: 0, and those before pos
            count = counts_ptr + row * (KV_HEADS if GROUPED else HEADS) + which
            if tl.atomic_add(count, 1, sem="acq_rel") == used - 1:  # the last one: the others' stores are seen
                for g in tl.static_range(group if GROUPED else 1):  # pyright: ignore[reportGeneralTypeIssues]
                    _merge_chunks(part_acc, part_stat, out_ptr, row, first + g, used, chunks, HEADS, HEAD_DIM,
                                  MAX_CHUNKS)
                tl.store(count, 0)


@triton.jit
def _head_partial(base, head, keys, values, l_mask, d, rotated, sign, cos, sin, scale, k_new, v_new, part_acc,
                  part_stat, at, HEAD_DIM: tl.constexpr, WITH_NEW: tl.constexpr):
    """One query head's softmax statistics and weighted values over a chunk's keys and values (and, WITH_NEW,
    the new token's k_new / v_new, fp32), stored at partial index `at`."""
    q = _rope(base + head * HEAD_DIM, d, rotated, sign, cos, sin) * scale
    scores = tl.where(l_mask, tl.sum(keys * q[None, :], axis=1), float("-inf"))
    if WITH_NEW:
        score_new = tl.sum(q * k_new, axis=0)
        best = tl.maximum(tl.max(scores, axis=0), score_new)
        p = tl.exp(scores - best)
        p_new = tl.exp(score_new - best)
        total = tl.sum(p, axis=0) + p_new
        acc = tl.sum(p[:, None] * values, axis=0) + p_new * v_new
    else:
        best = tl.max(scores, axis=0)
        p = tl.exp(scores - best)
        total = tl.sum(p, axis=0)
        acc = tl.sum(p[:, None] * values, axis=0)
    tl.store(part_acc + at * HEAD_DIM + d, acc)
    tl.store(part_stat + at * 2, best)
    tl.store(part_stat + at * 2 + 1, total)


@triton.jit
def _merge_chunks(part_acc, part_stat, out_ptr, row, head, used, chunks, HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """One head's output from its first `used` chunks' statistics and weighted values (read past L1: other
    programs of the same launch may have written them)."""
    c = tl.arange(0, MAX_CHUNKS)
    c_mask = c < used
    at = (row * HEADS + head) * chunks + c
    best = tl.load(part_stat + at * 2, mask=c_mask, other=float("-inf"), cache_modifier=".cg")
    total = tl.load(part_stat + at * 2 + 1, mask=c_mask, other=0.0, cache_modifier=".cg")
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc + at[:, None] * HEAD_DIM + d[None, :], mask=c_mask[:, None], other=0.0,
                  cache_modifier=".cg")
    weight = tl.where(c_mask, tl.exp(best - tl.max(best, axis=0)), 0.0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * total, axis=0)
    tl.store(out_ptr + row * HEADS * HEAD_DIM + head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _attention_group_kernel(qkv_ptr, k_cache, v_cache, part_acc, part_stat, slots_ptr, pos_ptr, cos_ptr, sin_ptr,
                            counts_ptr, out_ptr, stride_qkv, stride_slot, stride_head, stride_pos, scale, chunks,
                            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            CHUNK: tl.constexpr, TILE: tl.constexpr, GROUP_ROWS: tl.constexpr,
                            MAX_CHUNKS: tl.constexpr, MERGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                            USE_PDL: tl.constexpr):
    """Program (row, kv head, chunk): the KV head's query group as one matrix (GROUP_ROWS, padded to a tensor-core
    tile) against its cached K/V in tiles of TILE positions, with an online softmax over the chunk's tiles
    (FlashDecoding's split-K). The dots run on tensor cores and read each cached K/V once for the whole group,
    where the per-head kernel's reductions ran on the CUDA cores with the keys held in fp32 registers.

    As the chunk kernel: chunk 0 takes the new token from registers and writes its K/V into the cache, other
    chunks read only positions before it, and with MERGE the group's last chunk to finish merges them all.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    group: tl.constexpr = HEADS // KV_HEADS
    if USE_PDL:
        tl_cuda.gdc_launch_dependents()
    pos = tl.load(pos_ptr + row)
    start = chunk * CHUNK
    if chunk == 0 or start < pos:
        d = tl.arange(0, HEAD_DIM)
        g = tl.arange(0, GROUP_ROWS)
        g_mask = g < group
        half: tl.constexpr = HEAD_DIM // 2
        rotated = (d + half) % HEAD_DIM  # rotate_half: [-x2, x1]
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * HEAD_DIM + d)
        sin = tl.load(sin_ptr + pos * HEAD_DIM + d)
        cache_row = tl.load(slots_ptr + row) * stride_slot + kv_head * stride_head
        if USE_PDL:
            tl_cuda.gdc_wait()
        base = qkv_ptr + row * stride_qkv
        q_at = base + (kv_head * group + g)[:, None] * HEAD_DIM
        q = tl.load(q_at + d[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
        q_rotated = tl.load(q_at + rotated[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
        q = (q * cos[None, :] + sign[None, :] * q_rotated * sin[None, :]) * scale
        if chunk == 0:  # the new token joins chunk 0 (its score and value start the running sums)
            k_new = _rope(base + (HEADS + kv_head) * HEAD_DIM, d, rotated, sign, cos, sin).to(k_cache.dtype.element_ty)
            v_new = tl.load(base + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + d)
            tl.store(k_cache + cache_row + pos * stride_pos + d, k_new)
            tl.store(v_cache + cache_row + pos * stride_pos + d, v_new.to(v_cache.dtype.element_ty))
            best = tl.sum(q * k_new.to(tl.float32)[None, :], axis=1)
            total = tl.full([GROUP_ROWS], 1.0, tl.float32)
            acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32) + v_new.to(tl.float32)[None, :]
        else:
            best = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
            total = tl.zeros([GROUP_ROWS], tl.float32)
            acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
        q_dot = q.to(k_cache.dtype.element_ty)
        end = tl.minimum(start + CHUNK, pos)
        for tile in range(start, end, TILE):
            ls = tile + tl.arange(0, TILE)
            l_mask = ls < end
            offsets = cache_row + ls[:, None] * stride_pos + d[None, :]
            keys = tl.load(k_cache + offsets, mask=l_mask[:, None], other=0.0)
            values = tl.load(v_cache + offsets, mask=l_mask[:, None], other=0.0)
            scores = tl.dot(q_dot, tl.trans(keys), input_precision=DOT_PRECISION)
            scores = tl.where(l_mask[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            alpha = tl.exp(best - new_best)
            p = tl.exp(scores - new_best[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=DOT_PRECISION)
            best = new_best
        at = (row * HEADS + kv_head * group + g) * chunks + chunk
        tl.store(part_acc + at[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_stat + at * 2, best, mask=g_mask)
        tl.store(part_stat + at * 2 + 1, total, mask=g_mask)
        if MERGE:
            tl.debug_barrier()  # every thread's stores are issued before the count says this chunk is done
            used = tl.maximum(tl.cdiv(pos, CHUNK), 1)
            count = counts_ptr + row * KV_HEADS + kv_head
            if tl.atomic_add(count, 1, sem="acq_rel") == used - 1:
                for h in tl.static_range(group):  # pyright: ignore[reportGeneralTypeIssues]
                    _merge_chunks(part_acc, part_stat, out_ptr, row, kv_head * group + h, used, chunks, HEADS,
                                  HEAD_DIM, MAX_CHUNKS)
                tl.store(count, 0)


@triton.jit
def _attention_merge_kernel(part_acc, part_stat, pos_ptr, out_ptr, chunks, HEADS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                            USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:  # the o matmul after this can start fetching its weights now
        tl_cuda.gdc_launch_dependents()
        tl_cuda.gdc_wait()
    used = tl.maximum(tl.cdiv(tl.load(pos_ptr + row), CHUNK), 1)
    _merge_chunks(part_acc, part_stat, out_ptr, row, head, used, chunks, HEADS, HEAD_DIM, MAX_CHUNKS)


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                     kv_heads: int, counts: torch.Tensor | None = None, chunk: int | None = None,
                     grouped: bool = False, tile: int | None = None) -> torch.Tensor:
    """qkv [M, (heads + 2 kv_heads) * D] of one new token per row at `positions` [M] in cache `slots` [M].

    Writes the token's K/V into the caches ([slots, kv_heads, max_len, D]) and returns attention [M, heads * D].
    cos/sin are the fp32 RoPE tables [max_len, D]. The launch covers the whole cache length, so one
    captured graph serves every position; chunks past a row's position return at once.
    `counts`: int32 zeros, at least M × heads, for the chunks to merge themselves (see the chunk kernel); one
    buffer per stream of launches (the model's), as two launches at once would count into each other. Without
    it (or when too small) a second kernel merges. `chunk`: cached positions per program (default ATTN_CHUNK).
    `grouped`: a program per KV head's group of query heads (many rows: each cached K/V read once), else per
    query head (a few rows: eight times the programs to spread one token's attention over the GPU). `tile`: with
    `grouped`, the group's queries meet the chunk's K/V in tensor-core dots over tiles of this many positions
    (default ATTN_TILE; 0: the group's heads one by one on the CUDA cores).
    """
    rows = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and qkv.is_contiguous()
    chunk = chunk or ATTN_CHUNK
    chunks = triton.cdiv(k_cache.shape[2], chunk)
    part_acc = torch.empty(rows, heads, chunks, head_dim, dtype=torch.float32, device=qkv.device)
    part_stat = torch.empty(rows, heads, chunks, 2, dtype=torch.float32, device=qkv.device)
    out = torch.empty(rows, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    merge = counts is not None and counts.numel() >= rows * heads
    pdl = _use_pdl(qkv.device)
    max_chunks = triton.next_power_of_2(chunks)
    grouped = grouped and heads > kv_heads
    tile = ATTN_TILE if tile is None else tile
    if grouped and tile:
        assert tile >= 16 and tile & (tile - 1) == 0 and head_dim >= 16, (tile, head_dim)  # a tensor-core dot's
        launch(_attention_group_kernel, (rows, kv_heads, chunks))(
            qkv, k_cache, v_cache, part_acc, part_stat, slots, positions, cos, sin, counts if merge else positions,
            out, qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), head_dim ** -0.5, chunks,
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, CHUNK=chunk, TILE=tile,
            GROUP_ROWS=max(16, triton.next_power_of_2(heads // kv_heads)), MAX_CHUNKS=max_chunks, MERGE=merge,
            DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32", USE_PDL=pdl,
            num_warps=ATTN_WARPS_TILES, num_stages=ATTN_STAGES_TILES, launch_pdl=pdl)
    else:
        launch(_attention_chunk_kernel, (rows, kv_heads if grouped else heads, chunks))(
            qkv, k_cache, v_cache, part_acc, part_stat, slots, positions, cos, sin,
            counts if merge else positions, out, qkv.stride(0), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), head_dim ** -0.5, chunks, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            CHUNK=chunk, MAX_CHUNKS=max_chunks, MERGE=merge, GROUPED=grouped, USE_PDL=pdl,
            num_warps=ATTN_WARPS_BATCHED if grouped else ATTN_WARPS, launch_pdl=pdl)
    if not merge:
        launch(_attention_merge_kernel, (rows, heads))(
            part_acc, part_stat, positions, out, chunks, HEADS=heads, HEAD_DIM=head_dim, CHUNK=chunk,
            MAX_CHUNKS=max_chunks, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


@triton.jit
def _add_kernel(partial_ptr, residual_ptr, out_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if USE_PDL:
        tl_cuda.gdc_launch_dependents()
        tl_cuda.gdc_wait()
    total = tl.load(partial_ptr + offsets, mask=mask) + tl.load(residual_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(h_ptr, delta_ptr, weight_ptr, h_out, normed_out, n, eps, HAS_DELTA: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(h_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:  # the residual stream keeps its dtype, as the torch path's `h + delta` rounds it
        x = (x + tl.load(delta_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)).to(h_out.dtype.element_ty)
        tl.store(h_out + row * n + cols, x, mask=mask)
        x = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_out + row * n + cols, (x * scale * weight).to(normed_out.dtype.element_ty), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) · weight) for rows [M, N] in one launch (h itself, normed, without delta):
    the batched decode's residual add and next norm, where the torch path takes nine element-wise kernels.
    The sum rounds to h's dtype before the norm reads it, as the torch path's; the norm rounds once."""
    assert h.is_contiguous() and (delta is None or delta.shape == h.shape and delta.is_contiguous())
    rows, n = h.shape
    out = torch.empty_like(h) if delta is not None else h
    normed = torch.empty_like(h)
    launch(_add_rms_norm_kernel, (rows,))(h, delta if delta is not None else h, weight, out, normed, n, eps,
                                  HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n))
    return out, normed


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * 2 * inner + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inner + inner + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inner + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up of rows [M, 2I] holding [gate | up] -> [M, I], in fp32 and rounded once: one launch."""
    assert gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    launch(_silu_mul_kernel, (rows, triton.cdiv(inner, block)))(gate_up, out, inner, BLOCK=block)
    return out


def add_residual(partial: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + partial (fp32, e.g. after a tensor-parallel all-reduce), rounded once: one launch."""
    assert partial.shape == residual.shape and partial.is_contiguous() and residual.is_contiguous()
    out = torch.empty_like(residual)
    pdl = _use_pdl(residual.device)
    block = 1024
    launch(_add_kernel, (triton.cdiv(out.numel(), block),))(partial, residual, out, out.numel(), BLOCK=block,
                                                            USE_PDL=pdl, launch_pdl=pdl)
    return out
