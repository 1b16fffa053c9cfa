"""The denoising loop: flow matching from noise to a latent video over `steps` Euler steps, classifier-free guidance
(v = v_uncond + g (v_cond - v_uncond)), TeaCache, then the decoder to RGB frames.

TeaCache (Liu et al., 2024; the flag of seed 004): the transformer's output changes little between steps whose
timestep-modulated input changes little. Per branch, the relative L1 change of the first block's modulated input
is accumulated; while the sum stays under the threshold the step reuses the last computed residual (output minus
input) instead of calling the transformer. The first and last steps always compute. Threshold 0 never skips.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from hpc.runtime.engine.video.dit import Parallel, VaeDecoder, VideoDit


@dataclass(frozen=True)
class VideoJob:
    prompt_ids: list[int]
    negative_ids: list[int]
    height: int
    width: int
    frames: int
    steps: int
    guidance: float
    seed: int
    prompt: str = ""  # the text, for pipelines that tokenize themselves (TensorRT-LLM's visual generation)
    negative_prompt: str = ""


@dataclass
class Stats:
    transformer_calls: int = 0
    skipped_calls: int = 0  # TeaCache: steps of a branch that reused the last residual
    steps_done: int = 0
    branches: dict = field(default_factory=dict)  # TeaCache state per branch


class Cancelled(Exception):
    pass


def _branch_velocity(dit: VideoDit, latent: torch.Tensor, t: torch.Tensor, text: torch.Tensor, par: Parallel,
                     stats: Stats, branch: str, thresh: float, edge: bool) -> torch.Tensor:
    x = dit.tokens(latent)
    temb = dit.embed_time(t)
    state = stats.branches.setdefault(branch, {"acc": 0.0, "prev": None, "residual": None})
    modulated = dit.blocks[0].modulated_input(x, temb)
    skip = False
    if thresh > 0 and state["prev"] is not None and not edge:
        prev = state["prev"]
        state["acc"] += float((modulated - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12))
        skip = state["acc"] < thresh
    state["prev"] = modulated
    if skip:
        stats.skipped_calls += 1
        out = x + state["residual"]
    else:
        out = dit.run_blocks(x, temb, text, par)
        stats.transformer_calls += 1
        state["residual"], state["acc"] = out - x, 0.0
    return dit.untokens(out, temb, latent.shape)


@torch.inference_mode()
def generate(dit: VideoDit, vae: VaeDecoder, job: VideoJob, par: Parallel, thresh: float = 0.0,
             on_step: Callable[[int, int], None] = lambda done, total: None,
             cancelled: Callable[[], bool] = lambda: False) -> tuple[torch.Tensor, Stats]:
    """Frames [F, H, W, 3] uint8 (every rank computes them; rank 0 serves them) and what the loop did."""
    cfg = dit.cfg
    device = next(dit.parameters()).device
    dtype = next(dit.parameters()).dtype
    gen = torch.Generator().manual_seed(job.seed)
    shape = (1, cfg.latent_channels, job.frames, job.height // cfg.vae_factor, job.width // cfg.vae_factor)
    latent = torch.randn(shape, generator=gen).to(device, dtype)
    ids = [torch.tensor([job.prompt_ids or [0]], device=device), torch.tensor([job.negative_ids or [0]], device=device)]
    texts = [dit.embed_text(i) for i in ids]
    use_cfg = job.guidance != 1.0
    sigmas = torch.linspace(1.0, 0.0, job.steps + 1)
    stats = Stats()
    for i in range(job.steps):
        if cancelled():
            raise Cancelled()
        t = sigmas[i].reshape(1).to(device)
        edge = i == 0 or i == job.steps - 1
        if not use_cfg:
            v = _branch_velocity(dit, latent, t, texts[0], par, stats, "cond", thresh, edge)
        elif par.cfg_size == 2:  # this rank's branch; the other comes over the wire
            mine = _branch_velocity(dit, latent, t, texts[par.cfg_rank], par, stats, ("cond", "uncond")[par.cfg_rank],
                                    thresh, edge)
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine.contiguous(), group=par.cfg_group)
            v = both[1] + job.guidance * (both[0] - both[1])
        else:
            v_cond = _branch_velocity(dit, latent, t, texts[0], par, stats, "cond", thresh, edge)
            v_uncond = _branch_velocity(dit, latent, t, texts[1], par, stats, "uncond", thresh, edge)
            v = v_uncond + job.guidance * (v_cond - v_uncond)
        latent = latent + (sigmas[i + 1] - sigmas[i]).item() * v
        stats.steps_done = i + 1
        on_step(i + 1, job.steps)
    stats.branches = {}
    return vae(latent)[0].cpu(), stats
