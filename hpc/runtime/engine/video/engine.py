"""The video worker's engine: the tiny DiT loaded on this rank's device, one video at a time on a thread, progress
per step, cancellation agreed by every rank, and the MP4 written where the frontend asked.

Ranks: rank 0 serves; the others (CFG and Ulysses parallel) follow it: rank 0 broadcasts each job, and before each
step whether to go on, so a cancelled video stops on every rank at the same step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from hpc.runtime.engine.video.dit import Parallel, load_tiny_video
from hpc.runtime.engine.video.pipeline import Cancelled, Stats, VideoJob, generate
from hpc.runtime.engine.types import EngineBase, EngineTraits
from hpc.runtime.serve.wire import VideoRequest, VideoResult
from hpc.spec.diffusion import DiffusionSpec

log = logging.getLogger(__name__)
_JOB_BYTES = 65536


def parallel_groups(rank: int, world: int, spec: DiffusionSpec) -> Parallel:
    """Ranks are (cfg, ulysses) in row-major order; every rank creates every group, in the same order."""
    u, c = spec.dit_ulysses_size, spec.dit_cfg_size
    if u * c != world:
        raise RuntimeError(f"dit_cfg_size {c} x dit_ulysses_size {u} != {world} ranks")
    par = Parallel(ulysses_rank=rank % u, ulysses_size=u, cfg_rank=rank // u, cfg_size=c)
    if world == 1:
        return par
    for ci in range(c):
        group = dist.new_group([ci * u + ui for ui in range(u)])
        if ci == par.cfg_rank:
            par.ulysses_group = group
    for ui in range(u):
        group = dist.new_group([ci * u + ui for ci in range(c)])
        if ui == par.ulysses_rank:
            par.cfg_group = group
    return par


class VideoEngine(EngineBase):
    traits = EngineTraits(video=True)

    def __init__(self, model_path: str, spec: DiffusionSpec, device: str = "cpu", rank: int = 0, world: int = 1,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model_path = Path(model_path).expanduser()
        self.spec = spec
        self.device = torch.device(device)
        self.rank, self.world = rank, world
        self.dtype = dtype
        self.par = Parallel()
        self._lock = threading.Lock()  # one video at a time: the loop's collectives must not interleave
        self.counters = {"videos": 0, "cancelled": 0, "steps": 0, "transformer_calls": 0, "skipped_calls": 0}
        self.failure: str | None = None

    def load(self) -> None:
        self.cfg, self.dit, self.vae = load_tiny_video(self.model_path, str(self.device), self.dtype)
        self.par = parallel_groups(self.rank, self.world, self.spec)
        if self.cfg.num_heads % self.par.ulysses_size:
            raise RuntimeError(f"dit_ulysses_size {self.par.ulysses_size} does not divide the model's "
                               f"{self.cfg.num_heads} heads")
        log.info("video DiT on %s: rank %d of %d (cfg %d/%d, ulysses %d/%d), TeaCache threshold %g", self.device,
                 self.rank, self.world, self.par.cfg_rank, self.par.cfg_size, self.par.ulysses_rank,
                 self.par.ulysses_size, self.spec.thresh)

    async def __aenter__(self) -> "VideoEngine":
        await asyncio.to_thread(self.load)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.world > 1:
            await asyncio.to_thread(self._broadcast_job, None)  # the followers stop

    def stats(self) -> dict[str, float]:
        return dict(self.counters)

    # ---- rank 0 ------------------------------------------------------------------------------------------------
    async def generate_video(self, request: VideoRequest, on_step: Callable[[int, int], None],
                             cancel: threading.Event) -> VideoResult:
        return await asyncio.to_thread(self._run, request, on_step, cancel)

    def _run(self, request: VideoRequest, on_step, cancel: threading.Event) -> VideoResult:
        with self._lock:
            job = VideoJob(list(request.prompt_ids), list(request.negative_ids), request.height, request.width,
                           request.frames, request.steps, request.guidance, request.seed, request.prompt,
                           request.negative_prompt)
            if self.par.ulysses_size > 1:  # each rank takes an equal slice of the video's patches
                cell = self.cfg.vae_factor * self.cfg.patch  # pixels per patch, each side
                tokens = job.frames * (job.height // cell) * (job.width // cell)
                if tokens % self.par.ulysses_size:
                    raise ValueError(f"the video's {tokens} patches do not split over dit_ulysses_size "
                                     f"{self.par.ulysses_size}")
            if self.world > 1:
                self._broadcast_job(job)
            t0 = time.perf_counter()
            try:
                frames, stats = self._generate(job, on_step, lambda: self._agree(cancel.is_set()))
            except Cancelled:
                self.counters["cancelled"] += 1
                raise
            elapsed = time.perf_counter() - t0
            from hpc.runtime.engine.video.mp4 import write_mp4

            size = write_mp4(frames, request.fps, Path(request.output_path))
            self.counters["videos"] += 1
            self.counters["steps"] += stats.steps_done
            self.counters["transformer_calls"] += stats.transformer_calls
            self.counters["skipped_calls"] += stats.skipped_calls
            return VideoResult(path=request.output_path, frames=frames.shape[0], width=frames.shape[2],
                               height=frames.shape[1], fps=request.fps, size_bytes=size, inference_time_s=elapsed,
                               transformer_calls=stats.transformer_calls, skipped_calls=stats.skipped_calls)

    def _generate(self, job: VideoJob, on_step, cancelled) -> tuple[np.ndarray, Stats]:
        """Frames [F, H, W, 3] uint8 of one job (every rank runs it) and what the loop did."""
        frames, stats = generate(self.dit, self.vae, job, self.par, self.spec.thresh, on_step, cancelled)
        return frames.numpy(), stats

    def _agree(self, stop: bool) -> bool:
        """Whether to stop now, the same answer on every rank (rank 0's)."""
        if self.world == 1:
            return stop
        flag = torch.tensor([int(stop)], device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def _broadcast_job(self, job: VideoJob | None) -> None:
        data = json.dumps(None if job is None else job.__dict__).encode()
        buf = torch.zeros(_JOB_BYTES, dtype=torch.uint8, device=self.device)
        buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        dist.broadcast(buf, 0)

    # ---- ranks > 0 ---------------------------------------------------------------------------------------------
    def follow(self) -> None:
        while True:
            buf = torch.zeros(_JOB_BYTES, dtype=torch.uint8, device=self.device)
            dist.broadcast(buf, 0)
            raw = buf.cpu().numpy().tobytes().rstrip(b"\0")
            fields = json.loads(raw)
            if fields is None:
                return
            try:
                self._generate(VideoJob(**fields), lambda done, total: None, lambda: self._agree(False))
            except Cancelled:
                pass
