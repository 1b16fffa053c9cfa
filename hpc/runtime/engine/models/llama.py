"""A compact Llama-architecture decoder in torch, with a slot-based KV cache and tensor parallelism.

Weights use Hugging Face's LlamaForCausalLM names, so a checkpoint written here loads in transformers
too. With a process group, attention heads and MLP columns are split across ranks (Megatron style:
column-parallel q/k/v/gate/up, row-parallel o/down followed by an all-reduce).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch import nn

from hpc.runtime.engine.models.moe import ExpertParallel, SparseMoE

if TYPE_CHECKING:
    from hpc.runtime.engine.kernels.fused_decode import FusedDecoder


class KvCache(list):
    """The KV cache as the model reads it, per layer a [2, slots, kv_heads, max_len, head_dim] tensor: views of
    one [layers, 2, slots, ...] tensor (`whole`), so that one slot's KV over every layer moves in one kernel (the
    prefix cache's blocks, the KV handoff) instead of one per layer (32 on the 8B shape)."""

    def __init__(self, whole: torch.Tensor) -> None:
        super().__init__(whole.unbind(0))
        self.whole = whole


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    bos_token_id: int = 0
    eos_token_id: int = 1
    vision: dict | None = None  # {"image_size", "patch_size", "image_token_id", "num_image_tokens"}
    num_local_experts: int = 0  # > 0: a sparse mixture-of-experts feed-forward (Mixtral's names)
    num_experts_per_tok: int = 2

    @property
    def moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def load(cls, model_dir: Path) -> "LlamaConfig":
        raw = json.loads((model_dir / "config.json").read_text())
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        fields["vision"] = raw.get("hpc_vision")
        return cls(**fields)

    def to_hf(self) -> dict:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "vision"}
        data.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                    tie_word_embeddings=False, torch_dtype="float32", head_dim=self.head_dim)
        if self.moe:
            data.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
        else:
            del data["num_local_experts"], data["num_experts_per_tok"]
        if self.vision:
            data["hpc_vision"] = self.vision
        return data


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One bias-free linear layer whose output is the parts' outputs side by side. Made on the meta device, its
    weight then given: an nn.Linear made on the GPU draws a random initial weight from the device's generator,
    which fails while a CUDA graph capture holds that generator (and is work thrown away anyway)."""
    weight = torch.cat([part.weight for part in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


def rope_tables(cfg: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    t = torch.arange(cfg.max_position_embeddings, device=device).float()
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos/sin: [B, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class TensorParallel:
    """The rank's share of the model; `group` None means a single rank."""

    def __init__(self, rank: int = 0, size: int = 1, group=None) -> None:
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x


class Pipeline:
    """This rank's stage of a pipeline-parallel model: a contiguous run of the layers; hidden states go to the
    next stage by send/recv and the last stage's logits back to rank 0, which samples. `group` None: one stage."""

    def __init__(self, rank: int = 0, size: int = 1, group=None) -> None:
        self.rank, self.size, self.group = rank, size, group

    def layers(self, count: int) -> range:
        if count < self.size:
            raise ValueError(f"{count} layers do not split over {self.size} pipeline stages")
        bounds = [count * i // self.size for i in range(self.size + 1)]
        return range(bounds[self.rank], bounds[self.rank + 1])


def stage_state_dict(state: dict[str, torch.Tensor], cfg: "LlamaConfig",
                     pipeline: Pipeline) -> dict[str, torch.Tensor]:
    """This stage's layers of a full checkpoint, renumbered from 0; embeddings, final norm and head stay."""
    if pipeline.size == 1:
        return state
    own = pipeline.layers(cfg.num_hidden_layers)
    out = {}
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) in own:
                out[f"model.layers.{int(index) - own.start}.{rest}"] = tensor
        else:
            out[name] = tensor
    return out


@dataclass(frozen=True, slots=True)
class StepRows:
    """One side of a mixed step (LlamaForCausalLM.forward_mixed): embeds [B, T, H] at positions [B, T] in cache
    slots [B]; `window`: the cache positions attention reads (the longest row's end); `fresh`: every row starts
    at position 0; `last` [B]: each row's last real token (right-padded prompts)."""
    embeds: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    window: int
    fresh: bool = False
    last: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        if cfg.num_key_value_heads % tp.size or cfg.num_attention_heads % tp.size:
            raise ValueError(f"heads ({cfg.num_attention_heads}/{cfg.num_key_value_heads} kv) do not split "
                             f"over tensor-parallel size {tp.size}")
        self.tp = tp
        self.heads = cfg.num_attention_heads // tp.size
        self.kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def fuse(self) -> None:
        """One matmul for q, k and v: fewer, larger kernels (decode at small batch is bandwidth-bound)."""
        if hasattr(self, "qkv_proj"):
            return
        self.qkv_proj = fused_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, cache_k, cache_v, slots, positions, lengths, window=None,
                contiguous_slots=False, from_scratch=False, packed_mask=None, continuing=False):
        """x: [B, T, H]; positions: [B, T]; writes K/V into the cache slots, attends over `lengths`: the first
        `window` cache positions (the caller's longest row), or with `from_scratch` (one prompt from position 0)
        only to its own fresh K/V, or with `packed_mask` [1, 1, T, T] (prompts packed in one row, slots [1, T]
        per token) to the fresh K/V the mask allows, or with `continuing` (one row whose T positions are the
        last of its `window`) causally, aligned at the end."""
        if hasattr(self, "qkv_proj"):
            q, k, v = self.split(self.qkv_proj(x))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out = self.attend(q, k, v, cos, sin, cache_k, cache_v, slots, positions, lengths, window, contiguous_slots,
                          from_scratch, packed_mask, continuing)
        return self.tp.all_reduce(self.o_proj(out))

    def split(self, qkv: torch.Tensor) -> list[torch.Tensor]:
        """The fused projection's output [..., (heads + 2 kv_heads) * D] as q, k and v (views)."""
        return list(qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                               self.kv_heads * self.head_dim], dim=-1))

    def attend(self, q, k, v, cos, sin, cache_k, cache_v, slots, positions, lengths, window=None,
               contiguous_slots=False, from_scratch=False, packed_mask=None, continuing=False) -> torch.Tensor:
        """forward's attention, from the projections q [B, T, heads * D], k and v [B, T, kv_heads * D]: the
        heads' outputs [B, T, heads * D], before o_proj."""
        b, t, _ = q.shape
        q = q.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # cache_*: [slots, kv_heads, max_len, head_dim]. One indexed write for every row's tokens: no host sync
        # (CUDA-graph friendly; a sync per row and layer made a 64-token prefill of the tiny model 3 ms on a GPU)
        if t == 1 and slots.dim() == 1:
            cache_k[slots, :, positions[:, 0]] = k[:, :, 0]
            cache_v[slots, :, positions[:, 0]] = v[:, :, 0]
        else:
            rows = slots if slots.dim() == 2 else slots[:, None].expand(b, t)
            cache_k[rows, :, positions] = k.transpose(1, 2)
            cache_v[rows, :, positions] = v.transpose(1, 2)
        if packed_mask is not None:
            # K/V heads repeated: with a mask and grouped heads SDPA could leave its memory-efficient kernel for
            # the math one, an [H, T, T] matrix in fp32
            groups = self.heads // self.kv_heads
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                 attn_mask=packed_mask)
        elif from_scratch:
            # A prompt from position 0 attends to itself, causally: the fresh K/V, no mask, so SDPA takes its
            # flash / memory-efficient kernels (no per-shape cuDNN plan for every new prompt length).
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        elif continuing:
            # A prompt going on from its cached positions (a chunk after the first, a prefix-cache hit): each of
            # its queries sees every key up to its own position, causal aligned at the end (lower right), which
            # SDPA runs in its flash or memory-efficient kernels. Through the boolean mask below (grouped heads,
            # an arbitrary mask) it can take the math kernel, an [H, T, window] matrix: the likely reason a step
            # with a 1,024-token chunk of the 8B shape held the decoders as long as four whole 4,096-token prompts.
            groups = self.heads // self.kv_heads
            keys = cache_k[slots, :, :window].repeat_interleave(groups, 1)
            values = cache_v[slots, :, :window].repeat_interleave(groups, 1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(t, window))
        else:
            out = self._masked(q, cache_k, cache_v, slots, positions, lengths, window, contiguous_slots)
        return out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)

    def _masked(self, q, cache_k, cache_v, slots, positions, lengths, window, contiguous_slots) -> torch.Tensor:
        """Each query over the first `window` cache positions (the caller's longest row), masked to its own."""
        b = q.shape[0]
        if contiguous_slots:  # slots 0..B-1: a view of the cache, no gather copy
            keys, values = cache_k[:b, :, :window], cache_v[:b, :, :window]
        else:
            keys, values = cache_k[slots, :, :window], cache_v[slots, :, :window]
        key_pos = torch.arange(window, device=q.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < lengths[:, None, None])
        # grouped-query attention without materialising repeated K/V heads
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(1),
                                              enable_gqa=self.kv_heads != self.heads)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        if cfg.intermediate_size % tp.size:
            raise ValueError(f"intermediate size {cfg.intermediate_size} does not split over TP {tp.size}")
        inner = cfg.intermediate_size // tp.size
        self.tp = tp
        self.gate_proj = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, cfg.hidden_size, bias=False)

    def fuse(self) -> None:
        if hasattr(self, "gate_up_proj"):
            return
        self.gate_up_proj = fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, ep: ExpertParallel) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        if cfg.moe:
            self.block_sparse_moe = SparseMoE(cfg, tp, ep)
        else:
            self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return ffn(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, ep: ExpertParallel, layers: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, tp, ep) for _ in range(cfg.num_hidden_layers if layers is None
                                                                       else layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def decoder_layers(self) -> list[Layer]:
        """The layers, typed: to a type checker a ModuleList holds bare Modules."""
        return cast(list[Layer], list(self.layers))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel | None = None, pipeline: Pipeline | None = None,
                 ep: ExpertParallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel()
        self.pipeline = pipeline or Pipeline()
        self.ep = ep or ExpertParallel()
        self.model = Backbone(cfg, self.tp, self.ep, len(self.pipeline.layers(cfg.num_hidden_layers)))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fused_decode: FusedDecoder | None = None  # once enable_fused_decode() ran

    def enable_fused_decode(self) -> "LlamaForCausalLM":
        """Route every one-token step through the Triton decode kernels (needs Triton; see fused_decode)."""
        from hpc.runtime.engine.kernels.fused_decode import FusedDecoder

        self.fused_decode = FusedDecoder(self.fuse_projections())
        return self

    def takes_fused_path(self, embeds: torch.Tensor) -> bool:
        return self.fused_decode is not None and self.fused_decode.supports(embeds)

    def rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].device != device:
            self._rope = rope_tables(self.cfg, device)
        return self._rope

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> KvCache:
        """Per layer: a [2, slots, kv_heads, max_len, head_dim] tensor, all of them views of one. Preallocated
        whole: on a GPU without room for it, one line that says which settings size it (not an out-of-memory)."""
        attn = self.model.decoder_layers()[0].self_attn
        shape = (len(self.model.decoder_layers()), 2, slots, attn.kv_heads, max_len, attn.head_dim)
        if torch.device(device).type == "cuda":
            need = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            # the driver's free memory and this process's own cached blocks, which the allocator would reuse
            free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
                torch.cuda.memory_allocated(device)
            if need > free:
                raise ValueError(f"the KV cache ({slots} slots of {max_len} positions, {need / 2**30:.2f} GiB) does "
                                 f"not fit in the {free / 2**30:.2f} GiB free on {device}: lower max_batch_size or "
                                 f"max_seq_len (a recipe's limits set it), or give the worker a GPU of its own")
        return KvCache(torch.zeros(*shape, dtype=dtype, device=device))

    @torch.inference_mode()
    def forward_step(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     cache: list[torch.Tensor], last_only: bool = True, window: int | None = None,
                     contiguous_slots: bool = False, last: torch.Tensor | None = None,
                     packed: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [B, T, H] at positions [B, T] -> logits of each row's last position [B, V].

        `window` fixes how many cache positions attention reads (instead of the longest row), and
        `contiguous_slots` promises slots == 0..B-1: together they make a decode step capturable in a
        CUDA graph. `last` [B]: the position whose logits each row returns (right-padded prompts).
        `packed` [T]: one row holds several prompts from position 0, token t belongs to prompt packed[t] and
        goes to cache slot slots[0, t]; `last` [R] then indexes each prompt's last token (prefill_graphs).
        """
        if packed is not None:
            mask = (packed[:, None] == packed[None, :]) & torch.ones(
                packed.shape[0], packed.shape[0], dtype=torch.bool, device=packed.device).tril()
            h = self._layers(embeds, positions, slots, cache, None, False, mask[None, None])
            return self.lm_head(self.model.norm(h[0, last])).float()
        fused = self.fused_decode
        if fused is not None and fused.supports(embeds):
            return fused(embeds, positions, slots, cache)
        p = self.pipeline
        h = embeds
        if p.rank > 0:  # the previous stage's hidden states
            h = torch.empty_like(embeds)
            torch.distributed.recv(h, p.rank - 1, group=p.group)
        h = self._layers(h, positions, slots, cache, window, contiguous_slots)
        if p.rank < p.size - 1:
            torch.distributed.send(h.contiguous(), p.rank + 1, group=p.group)
            logits = torch.empty(*h.shape[:1 if last_only else 2], self.cfg.vocab_size, device=h.device)
        else:
            if last_only:  # each row's last token, or with `last` [B] the row's own (right-padded prompts)
                h = h[:, -1] if last is None else h[torch.arange(h.shape[0], device=h.device), last]
            logits = self.lm_head(self.model.norm(h)).float()
        if p.size > 1:  # rank 0 samples: the last stage's logits go back to it
            if p.rank == p.size - 1:
                torch.distributed.send(logits.contiguous(), 0, group=p.group)
            elif p.rank == 0:
                torch.distributed.recv(logits, p.size - 1, group=p.group)
        return logits

    @torch.inference_mode()
    def forward_mixed(self, decode: "StepRows | None", parts: "list[StepRows]",
                      cache: list[torch.Tensor]) -> torch.Tensor:
        """One pass over decoding rows (a token each; None: none, a prefill alone) and prompt rows (`parts`, each
        right-padded rows that attend alike: fresh prompts together, a prompt going on from its cache alone): the
        matmuls over all their tokens at once, so a step's one read of each weight serves them all; attention
        apart, the decode rows' through the decode kernel (without it, the masked path) and each part's as a
        prefill's. With the fused kernels, each residual add and the norm after it, and the MLP's activation, in a
        launch each (FusedDecoder.layers). Logits [D + rows, V]: each decode row's, then each part's rows' at their
        `last` positions. One rank, one stage."""
        decode_heads = self._decode_attention(decode)
        d = 0 if decode is None else decode.positions.shape[0]
        part_heads = [self._part_attention(part) for part in parts]
        sizes = [part.positions.numel() for part in parts]

        def attend(attn: Attention, qkv: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            """qkv [tokens, (heads + 2 kv_heads) * head_dim] -> heads [tokens, heads * head_dim]"""
            heads, start = [] if decode_heads is None else [decode_heads(attn, qkv[:d], kv)], d
            for part_attend, size in zip(part_heads, sizes):
                heads.append(part_attend(attn, qkv[start:start + size], kv))
                start += size
            return heads[0] if len(heads) == 1 else torch.cat(heads)

        hidden = self.cfg.hidden_size
        h = torch.cat(([] if decode is None else [decode.embeds.reshape(d, hidden)])
                      + [part.embeds.reshape(-1, hidden) for part in parts])
        fused = self.fused_decode
        normed = fused.layers(h, cache, attend) if fused is not None else self._flat_layers(h, cache, attend)
        device, rows, start = h.device, [torch.arange(d, device=h.device)], d
        for part, size in zip(parts, sizes):
            assert part.last is not None, "a prompt row's logits come from its last token"
            b, t = part.positions.shape
            rows.append(start + torch.arange(b, device=device) * t + part.last)
            start += size
        return self.lm_head(normed[torch.cat(rows)]).float()

    def _part_attention(self, part: "StepRows"):
        """forward_mixed's attention for one part of its prompt rows, (attn, qkv [B * T, ...], kv) -> heads."""
        b, t = part.positions.shape
        cos_t, sin_t = self.rope(part.embeds.device)
        dtype = part.embeds.dtype
        cos, sin = cos_t[part.positions].to(dtype), sin_t[part.positions].to(dtype)
        lengths = part.positions[:, -1] + 1
        continuing = not part.fresh and b == 1

        def attend(attn: Attention, qkv: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            q, k, v = (x.reshape(b, t, -1) for x in attn.split(qkv))
            return attn.attend(q, k, v, cos, sin, kv[0], kv[1], part.slots, part.positions, lengths, part.window,
                               False, part.fresh, None, continuing).reshape(b * t, -1)
        return attend

    def _decode_attention(self, decode: "StepRows | None"):
        """forward_mixed's attention for its decode rows, (attn, qkv [D, ...], kv) -> [D, heads * head_dim]: the
        decode kernel, or without it the torch path's, as a part of D rows of one token."""
        if decode is None:
            return None
        positions = decode.positions[:, 0].contiguous()
        fused = self.fused_decode
        if fused is not None:
            return lambda attn, qkv, kv: fused.attention(attn, qkv, kv, decode.slots, positions)
        return self._part_attention(decode)  # rows of one token each, over their cache

    def _flat_layers(self, h: torch.Tensor, cache: list[torch.Tensor], attend) -> torch.Tensor:
        """The layers over tokens h [N, H] through the torch modules, attention by `attend` (forward_mixed's);
        the final norm's output."""
        for layer, kv in zip(self.model.decoder_layers(), cache):
            attn = layer.self_attn
            h = h + attn.tp.all_reduce(attn.o_proj(attend(attn, attn.qkv_proj(layer.input_layernorm(h)), kv)))
            h = h + layer.feed_forward(h)
        return self.model.norm(h)

    def _layers(self, h, positions, slots, cache, window, contiguous_slots, packed_mask=None) -> torch.Tensor:
        """This stage's layers (all of them without pipeline parallelism)."""
        cos_t, sin_t = self.rope(h.device)
        cos, sin = cos_t[positions].to(h.dtype), sin_t[positions].to(h.dtype)
        lengths = positions[:, -1] + 1
        # read from the device once per step, not in every layer (packed prompts: never, they are graphed)
        prompts = packed_mask is None and window is None and positions.shape[1] > 1
        # Rows that all start at position 0 (fresh prompts, right-padded to the longest) attend causally to
        # themselves: a real token sees only its own row's earlier tokens, which are real; a padded one's output
        # is never read. SDPA then runs a fused kernel; with a mask it took the math one in fp32, whose
        # [rows, heads, T, T] scores were 60 % of an 8 x 1,024 prefill of the 8B shape on an H200.
        from_scratch = prompts and not bool(positions[:, 0].any())
        continuing = prompts and positions.shape[0] == 1 and not from_scratch  # one prompt's next tokens
        if not from_scratch and window is None and packed_mask is None:
            window = int(lengths.max())
        for layer, kv in zip(self.model.decoder_layers(), cache):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, kv[0], kv[1], slots, positions, lengths,
                                    window, contiguous_slots, from_scratch, packed_mask, continuing)
            h = h + layer.feed_forward(h)
        return h

    def fuse_projections(self) -> "LlamaForCausalLM":
        """After loading: q/k/v and gate/up as single matmuls (the checkpoint keeps HF's names). Idempotent."""
        for layer in self.model.decoder_layers():
            layer.self_attn.fuse()
            if hasattr(layer, "mlp"):
                layer.mlp.fuse()
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)


# Megatron-style plan in torch's tensor-parallel terms: column-parallel weights shard their output rows
# (Shard(0)), row-parallel ones their input columns (Shard(1)); the rest is replicated.
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")  # w1/w3/w2: experts (EP 1)
_ROWWISE = ("o_proj", "down_proj", "w2")


def shard_state_dict(state: dict[str, torch.Tensor], tp: TensorParallel,
                     experts_whole: bool = False) -> dict[str, torch.Tensor]:
    """This rank's slice of a full checkpoint, cut by torch's DTensor placements over the TP group.

    Every rank reads the whole checkpoint, so no data moves (`src_data_rank=None`): each keeps its local
    shard as a plain tensor, which the fused kernels and CUDA-graph replay need. `experts_whole`: expert
    parallelism holds each expert whole on one rank instead of sharding every expert.
    """
    if tp.size == 1:
        return state
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    meshes: dict[str, DeviceMesh] = {}
    out = {}
    for name, tensor in state.items():
        layer = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        dim = 0 if layer in _COLWISE else 1 if layer in _ROWWISE else None
        if dim is None or (experts_whole and ".experts." in name):
            out[name] = tensor
            continue
        mesh = meshes.get(tensor.device.type)
        if mesh is None:
            mesh = meshes[tensor.device.type] = DeviceMesh.from_group(tp.group, tensor.device.type)
        out[name] = distribute_tensor(tensor, mesh, [Shard(dim)], src_data_rank=None).to_local().contiguous()
    return out


class VisionEncoder(nn.Module):
    """A small patch encoder: image [3, S, S] -> [num_patches, hidden] embeddings."""

    def __init__(self, hidden: int, image_size: int, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.image_size = image_size
        self.proj = nn.Linear(3 * patch_size * patch_size, hidden)
        self.mix = nn.Linear(hidden, hidden)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        patches = pixels.unfold(1, p, p).unfold(2, p, p)  # [3, n, n, p, p]
        patches = patches.permute(1, 2, 0, 3, 4).reshape(-1, 3 * p * p)
        return self.mix(F.gelu(self.proj(patches)))


def random_state(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """A whole random-weight checkpoint made where it will run (seconds on a GPU for 8B shapes), from a seeded
    generator: every rank and every worker that asks gets the same weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(cfg).named_parameters()}
    state = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            # drawn in place in the weights' own dtype: fp32 draws cast after left their blocks cached, each 2 GiB
            # block of an 8B shape's embeddings pinned by the bf16 half it held (8.5 GiB a worker, session 38)
            state[name] = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 1.0 / shape[-1] ** 0.5,
                                                                              generator=gen)
    return state


def init_weights(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif param.dim() >= 2:
            std = 1.0 / math.sqrt(param.shape[-1])
            param.data.copy_(torch.randn(param.shape, generator=gen) * std)
        else:
            param.data.zero_()
