"""A tiny video DiT: latent video [C, F, h, w] cut into (1 x 2 x 2) patches, blocks of self-attention, cross-
attention to the prompt's tokens and an MLP, each modulated by the timestep (adaLN, as DiT/Wan do), and a small
VAE-style decoder from latents (8x smaller in height and width) to RGB frames.

Parallel over ranks (`Parallel`): Ulysses sequence parallelism gives each rank a slice of the video's tokens and
swaps it for a slice of the heads around self-attention (all-to-all), so every rank attends over the whole
sequence; classifier-free guidance runs its two branches on two ranks. Either, or both, equal one rank in fp32.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpc.spec.diffusion import TINY_VIDEO


@dataclass(frozen=True)
class VideoDitConfig:
    vocab_size: int
    latent_channels: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 2
    patch: int = 2  # spatial patch (time patch 1)
    vae_factor: int = 8  # pixels per latent cell, each side
    max_frames: int = TINY_VIDEO.max_frames
    max_text_tokens: int = 64

    def to_json(self) -> dict:
        return {"model_type": "hpc_video_dit", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "VideoDitConfig":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class Parallel:
    """This rank's place among a worker's ranks: `ulysses` shares one branch's tokens, `cfg` splits the branches."""

    ulysses_rank: int = 0
    ulysses_size: int = 1
    ulysses_group: object = None
    cfg_rank: int = 0
    cfg_size: int = 1
    cfg_group: object = None
    all_to_all_calls: int = 0  # what crossed ranks, for the tests

    @property
    def world(self) -> int:
        return self.ulysses_size * self.cfg_size


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * 1000 * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: VideoDitConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, eps=1e-6)
        self.q_text = nn.Linear(h, h)
        self.kv_text = nn.Linear(h, 2 * h)
        self.proj_text = nn.Linear(h, h)
        self.norm3 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(approximate="tanh"), nn.Linear(4 * h, h))
        self.modulation = nn.Linear(h, 6 * h)  # shift/scale/gate for attention and MLP, from the timestep

    def modulated_input(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """What TeaCache watches: the first normalized, timestep-modulated input."""
        shift, scale = self.modulation(temb).chunk(6, dim=-1)[:2]
        return self.norm1(x) * (1 + scale[:, None]) + shift[:, None]

    def forward(self, x: torch.Tensor, temb: torch.Tensor, text: torch.Tensor, par: Parallel) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(temb).chunk(6, dim=-1)
        b, s, h = x.shape
        y = self.norm1(x) * (1 + scale1[:, None]) + shift1[:, None]
        q, k, v = self.qkv(y).view(b, s, 3, self.heads, h // self.heads).unbind(2)  # [b, s_local, heads, d]
        if par.ulysses_size > 1:  # tokens split -> heads split: attend over the whole sequence
            q, k, v = (_seq_to_heads(t, par) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        if par.ulysses_size > 1:
            out = _heads_to_seq(out, par)
        x = x + gate1[:, None] * self.proj(out.reshape(b, s, h))
        tq = self.q_text(self.norm2(x)).view(b, s, self.heads, -1).transpose(1, 2)
        tk, tv = self.kv_text(text).view(b, text.shape[1], 2, self.heads, -1).unbind(2)
        cross = F.scaled_dot_product_attention(tq, tk.transpose(1, 2), tv.transpose(1, 2)).transpose(1, 2)
        x = x + self.proj_text(cross.reshape(b, s, h))
        y = self.norm3(x) * (1 + scale2[:, None]) + shift2[:, None]
        return x + gate2[:, None] * self.mlp(y)


def _all_to_all(recv: list[torch.Tensor], send: list[torch.Tensor], par: Parallel) -> None:
    """dist.all_to_all, or where the backend lacks it (gloo before torch 2.12) the same exchange by all_gather."""
    par.all_to_all_calls += 1
    try:
        dist.all_to_all(recv, send, group=par.ulysses_group)
        return
    except RuntimeError as exc:
        if "alltoall" not in str(exc):
            raise
    mine = torch.stack(send)
    every = [torch.empty_like(mine) for _ in range(par.ulysses_size)]
    dist.all_gather(every, mine, group=par.ulysses_group)
    for source, theirs in enumerate(every):
        recv[source].copy_(theirs[par.ulysses_rank])


def _seq_to_heads(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """[b, s/P, H, d] on each rank -> [b, s, H/P, d]: rank r keeps heads r*H/P.. of every rank's tokens."""
    p = par.ulysses_size
    b, s, heads, d = t.shape
    send = list(t.reshape(b, s, p, heads // p, d).permute(2, 0, 1, 3, 4).contiguous().unbind(0))
    recv = [torch.empty_like(send[0]) for _ in range(p)]
    _all_to_all(recv, send, par)
    return torch.cat(recv, dim=1)


def _heads_to_seq(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """The inverse: [b, s, H/P, d] -> [b, s/P, H, d]."""
    p = par.ulysses_size
    send = list(t.chunk(p, dim=1))
    send = [x.contiguous() for x in send]
    recv = [torch.empty_like(send[0]) for _ in range(p)]
    _all_to_all(recv, send, par)
    return torch.cat(recv, dim=2)


class VideoDit(nn.Module):
    def __init__(self, cfg: VideoDitConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, p, c = cfg.hidden_size, cfg.patch, cfg.latent_channels
        self.patch_in = nn.Linear(c * p * p, h)
        self.text_embed = nn.Embedding(cfg.vocab_size, h)
        self.text_proj = nn.Sequential(nn.Linear(h, h), nn.GELU(approximate="tanh"), nn.Linear(h, h))
        self.time_embed = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))
        self.pos_frame = nn.Embedding(cfg.max_frames, h)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm_out = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.modulation_out = nn.Linear(h, 2 * h)
        self.patch_out = nn.Linear(h, c * p * p)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_proj(self.text_embed(ids))

    def embed_time(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_embed(timestep_embedding(t, self.cfg.hidden_size))

    def tokens(self, latent: torch.Tensor) -> torch.Tensor:
        """[b, C, F, h, w] -> [b, F*(h/p)*(w/p), hidden], with a per-frame position."""
        b, c, f, hh, ww = latent.shape
        p = self.cfg.patch
        x = latent.reshape(b, c, f, hh // p, p, ww // p, p).permute(0, 2, 3, 5, 1, 4, 6)
        x = self.patch_in(x.reshape(b, f, (hh // p) * (ww // p), c * p * p))
        x = x + self.pos_frame(torch.arange(f, device=latent.device))[None, :, None]
        return x.reshape(b, -1, self.cfg.hidden_size)

    def untokens(self, x: torch.Tensor, temb: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        b, c, f, hh, ww = shape
        p = self.cfg.patch
        shift, scale = self.modulation_out(temb).chunk(2, dim=-1)
        x = self.patch_out(self.norm_out(x) * (1 + scale[:, None]) + shift[:, None])
        x = x.reshape(b, f, hh // p, ww // p, c, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return x.reshape(shape)

    def run_blocks(self, x: torch.Tensor, temb: torch.Tensor, text: torch.Tensor, par: Parallel) -> torch.Tensor:
        """The transformer over the tokens; with Ulysses each rank runs its slice and the slices are gathered."""
        if par.ulysses_size == 1:
            for block in self.blocks:
                x = block(x, temb, text, par)
            return x
        local = x.chunk(par.ulysses_size, dim=1)[par.ulysses_rank].contiguous()
        for block in self.blocks:
            local = block(local, temb, text, par)
        parts = [torch.empty_like(local) for _ in range(par.ulysses_size)]
        dist.all_gather(parts, local, group=par.ulysses_group)
        return torch.cat(parts, dim=1)


class VaeDecoder(nn.Module):
    """Latent [b, C, F, h, w] -> RGB frames [b, F, 8h, 8w, 3] in 0..255 (three x2 upsamplings)."""

    def __init__(self, cfg: VideoDitConfig) -> None:
        super().__init__()
        c, width = cfg.latent_channels, 32
        self.inp = nn.Conv2d(c, width, 3, padding=1)
        self.ups = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(int(math.log2(cfg.vae_factor))))
        self.out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = latent.shape
        x = latent.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        x = F.silu(self.inp(x))
        for conv in self.ups:
            x = F.silu(conv(F.interpolate(x, scale_factor=2, mode="nearest")))
        rgb = torch.tanh(self.out(x))  # [-1, 1]
        rgb = ((rgb + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        return rgb.reshape(b, f, 3, rgb.shape[-2], rgb.shape[-1]).permute(0, 1, 3, 4, 2)


def build_tiny_video(out_dir: Path, seed: int = 4321) -> Path:
    """The tokenizer (shared with the tiny LLM), a random-weight DiT and decoder, then config.json last."""
    from safetensors.torch import save_file

    from hpc.runtime.engine.models.llama import init_weights
    from hpc.runtime.engine.models.tiny_tokenizer import train_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = VideoDitConfig(vocab_size=train_tokenizer(out_dir))
    dit, vae = VideoDit(cfg), VaeDecoder(cfg)
    init_weights(dit, seed)  # random gates, not adaLN-zero: a zero-initialised random model would be an identity
    for name, param in dit.named_parameters():  # gentle modulation, as trained DiTs have: the timestep shifts and
        if "modulation" in name:                # scales the tokens, it does not replace them (TeaCache relies on it)
            param.data.mul_(0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in sorted(vae.named_parameters()):  # fan-in scaled, so frames are not all saturated
        param.data.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param[0].numel())
                         if param.dim() > 1 else torch.zeros_like(param))
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(out_dir / "dit.safetensors"))
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(out_dir / "vae.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg.to_json(), indent=2))
    return out_dir


def load_tiny_video(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from safetensors.torch import load_file

    data = json.loads((model_dir / "config.json").read_text())
    if data.get("model_type") != "hpc_video_dit":
        raise ValueError(f"{model_dir} holds a {data.get('model_type')!r} model, not hpc's video DiT "
                         "(model.generate: tiny-video builds one)")
    cfg = VideoDitConfig.from_json(data)
    dit, vae = VideoDit(cfg), VaeDecoder(cfg)
    dit.load_state_dict(load_file(str(model_dir / "dit.safetensors")))
    vae.load_state_dict(load_file(str(model_dir / "vae.safetensors")))
    return cfg, dit.to(device, dtype).eval(), vae.to(device, dtype).eval()
