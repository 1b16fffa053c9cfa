"""The decode step through the fused Triton kernels (`decode_kernels`): five launches per layer.

With tensor parallelism each row-parallel matmul adds an all-reduce and a residual-add launch.

Every one-token step takes this path. Up to `MAX_BATCH` rows the matmuls are the fused GEMVs; past it either those
or cuBLAS matmuls (one read of each weight for all rows), whichever a batch size's CUDA graph replays faster
(DecodeGraphs.capture; eager steps take cuBLAS), but attention stays the Triton decode kernel: one
attention path for every batch size, whose launch covers the whole cache and reads positions from device
memory, so no step's shape is new to it (torch's SDPA builds a cuDNN plan for each new (batch, KV length),
33 ms median on first use, and the KV length changed every step) and every step can be captured in a CUDA
graph. Prefill takes the torch path (`LlamaForCausalLM.forward_step`), which is also the reference these
kernels are tested against.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

ATTENTION_COUNTS = 1 << 16  # (row, head) pairs whose attention chunks merge themselves: 256 KB
# Not before the all-reduce over peer memory: its programs would start waiting on the GEMV's while the next GEMV,
# which the all-reduce lets launch at once, takes the SMs too (TP=2, 8B shape, batch 1: 375.3 tok/s against 369.6)
EARLY_BEFORE_PEER_REDUCE = False
MAX_BATCH = 4  # past this a batched matmul (one read of each weight for all rows) is faster: 3.2k vs 4.4k tok/s at 8
# rows for the 8B shape; for a small model the GEMVs stay faster (their weights stay in L2 for every row, while the
# batched path is four times the launches: the tiny model's graphed step on an H200, 8 rows, 188 µs against 76 at
# 4 rows). A step's graph is captured on whichever of PATHS its own replays show faster (DecodeGraphs.capture).
PATHS = ("gemv", "batched")


def available(cfg, device: torch.device) -> bool:
    """Triton is importable, the device is a GPU, and the head size is a power of two (a Triton block)."""
    if device.type != "cuda" or cfg.head_dim & (cfg.head_dim - 1):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class FusedDecoder:
    def __init__(self, model) -> None:
        from hpc.runtime.engine.kernels import decode_kernels

        self.kernels = decode_kernels
        self.model = model
        self.eps = model.cfg.rms_norm_eps
        # the attention chunks' arrival counts: the model's own, as its steps run one after another on one stream
        self.counts = torch.zeros(ATTENTION_COUNTS, dtype=torch.int32, device=model.lm_head.weight.device)
        self.peer = None  # the all-reduce over peer memory, where the TP ranks share a node (peer_reduce)
        self.forced: str | None = None  # the path every step takes while set (path())
        if model.tp.size > 1 and model.lm_head.weight.is_cuda:
            from hpc.runtime.engine.kernels.peer_reduce import PeerReduce

            self.peer = PeerReduce.connect(model.tp.group, model.lm_head.weight.device, MAX_BATCH,
                                           model.cfg.hidden_size)

    def supports(self, embeds: torch.Tensor) -> bool:
        return embeds.shape[1] == 1

    def paths_for(self, rows: int) -> tuple[str, ...]:
        """The paths a step of `rows` may take: either past MAX_BATCH, else the GEMVs'; the batched one alone with
        experts (the GEMV chain has no router) or TP over peer memory (its buffers hold MAX_BATCH rows)."""
        if self.model.cfg.moe or self.peer is not None and rows > MAX_BATCH:
            return ("batched",)
        return PATHS if rows > MAX_BATCH else ("gemv",)

    @contextlib.contextmanager
    def path(self, name: str) -> Iterator[None]:
        """Every step takes path `name` (one of PATHS) inside: a graph captured there keeps it."""
        self.forced = name
        try:
            yield
        finally:
            self.forced = None

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 cache: list[torch.Tensor]) -> torch.Tensor:
        """embeds [B, 1, H] at positions [B, 1] in cache slots [B] -> fp32 logits [B, V]."""
        rows = embeds.shape[0]
        chosen = self.forced if self.forced in self.paths_for(rows) else self.paths_for(rows)[-1]
        if chosen == "batched":
            return self.batched(embeds, positions, slots, cache)
        gemv, model = self.kernels.gemv, self.model
        cos, sin = model.rope(embeds.device)
        pos = positions[:, 0].contiguous()
        h = embeds[:, 0].contiguous()
        for layer, kv in zip(model.model.decoder_layers(), cache):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = gemv(h, attn.qkv_proj.weight, norm=layer.input_layernorm.weight, eps=self.eps)
            heads = self.kernels.decode_attention(qkv, kv[0], kv[1], slots, pos, cos, sin, attn.heads,
                                                  attn.kv_heads, self.counts, self.kernels.ATTN_CHUNK)
            h = self._row_parallel(heads, attn.o_proj.weight, h, slot=0)
            gate_up = gemv(h, mlp.gate_up_proj.weight, norm=layer.post_attention_layernorm.weight, eps=self.eps)
            h = self._row_parallel(gate_up, mlp.down_proj.weight, h, slot=1, silu_mul=True)
        return gemv(h, model.lm_head.weight, norm=model.model.norm.weight, eps=self.eps, out_dtype=torch.float32)

    def batched(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: list[torch.Tensor]) -> torch.Tensor:
        """Past MAX_BATCH rows: the model's own (cuBLAS) projections around the Triton attention (layers)."""
        pos = positions[:, 0].contiguous()
        normed = self.layers(embeds[:, 0].contiguous(), cache,
                             lambda attn, qkv, kv: self.attention(attn, qkv, kv, slots, pos))
        return self.model.lm_head(normed).float()

    def layers(self, h: torch.Tensor, cache: list[torch.Tensor], attend: Callable) -> torch.Tensor:
        """The layers over tokens h [N, H] (contiguous): the model's (cuBLAS) projections, attention by
        `attend(attn, qkv, kv)` -> [N, heads * D]; each residual add and the norm after it in one launch
        (add_rms_norm), the MLP's activation in one (silu_mul); experts through the model's own feed-forward.
        The final norm's output [N, H]. A batched decode step's, and a mixed step's (forward_mixed)."""
        model, kernels = self.model, self.kernels
        layers = model.model.decoder_layers()
        norms = [layer.input_layernorm.weight for layer in layers[1:]] + [model.model.norm.weight]
        h, normed = kernels.add_rms_norm(h, None, layers[0].input_layernorm.weight, self.eps)
        for layer, kv, next_norm in zip(layers, cache, norms):
            attn = layer.self_attn
            attended = model.tp.all_reduce(attn.o_proj(attend(attn, attn.qkv_proj(normed), kv)))
            if model.cfg.moe:
                h = h + attended
                h, normed = kernels.add_rms_norm(h, layer.feed_forward(h).contiguous(), next_norm, self.eps)
                continue
            h, normed = kernels.add_rms_norm(h, attended, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            down = model.tp.all_reduce(mlp.down_proj(kernels.silu_mul(mlp.gate_up_proj(normed))))
            h, normed = kernels.add_rms_norm(h, down, next_norm, self.eps)
        return normed

    def attention(self, attn, qkv: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """Rows' attention [rows, heads * D] from their fused projections qkv [rows, ...] (contiguous), each row's
        token at `positions` [rows] in cache `slots`, as a batched step runs it (a mixed step's decode rows too)."""
        kernels = self.kernels
        cos, sin = self.model.rope(qkv.device)
        return kernels.decode_attention(qkv, kv[0], kv[1], slots, positions, cos, sin, attn.heads, attn.kv_heads,
                                        self.counts, kernels.ATTN_CHUNK_BATCHED, grouped=kernels.ATTN_GROUPED_BATCHED)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, slot: int,
                      silu_mul: bool = False) -> torch.Tensor:
        """The residual stream plus a row-parallel matmul; with TP the partial sums meet in fp32 (over peer
        memory in `slot` where the ranks share a node)."""
        tp = self.model.tp
        if tp.size == 1:
            return self.kernels.gemv(x, weight, silu_mul=silu_mul, residual=residual)
        if self.peer is not None:
            self.kernels.gemv(x, weight, silu_mul=silu_mul, out=self.peer.slot(slot, x.shape[0]),
                              early_trigger=self.kernels.GEMV_EARLY_TRIGGER and EARLY_BEFORE_PEER_REDUCE)
            return self.peer.reduce_add(slot, residual)
        partial = self.kernels.gemv(x, weight, silu_mul=silu_mul, out_dtype=torch.float32)
        tp.all_reduce(partial)
        # add in fp32 and round once, as the TP=1 kernel's residual epilogue does
        return self.kernels.add_residual(partial, residual)
