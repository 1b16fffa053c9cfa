"""Video diffusion on the reference engine (seed 004): the tiny DiT's loop, TeaCache, and CFG- and Ulysses-
parallel runs over gloo that equal one rank in fp32, through the worker engine's own job broadcast."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpc.runtime.engine.video.dit import Parallel, load_tiny_video
from hpc.runtime.engine.video.engine import VideoEngine
from hpc.runtime.engine.video.mp4 import read_mp4
from hpc.runtime.engine.video.pipeline import VideoJob, generate
from hpc.runtime.serve.wire import VideoRequest
from hpc.spec.diffusion import DiffusionSpec

JOB = VideoJob(prompt_ids=[5, 6, 7, 8], negative_ids=[9], height=64, width=64, frames=8, steps=12, guidance=5.0,
               seed=3)


@pytest.fixture(scope="module")
def video_model(model_cache):
    from hpc.runtime.engine.builds import ensure_model

    return ensure_model(str(model_cache / "tiny-video"), "tiny-video")


@pytest.mark.unit
def test_teacache_skips_transformer_calls_within_a_bounded_change_and_zero_is_identical(video_model):
    _, dit, vae = load_tiny_video(video_model)
    plain, stats = generate(dit, vae, JOB, Parallel())
    assert plain.shape == (8, 64, 64, 3) and plain.dtype == torch.uint8
    assert stats.transformer_calls == 2 * JOB.steps and stats.skipped_calls == 0  # two CFG branches per step
    same, zero = generate(dit, vae, JOB, Parallel(), thresh=0.0)
    assert torch.equal(same, plain) and zero.skipped_calls == 0
    cached, tea = generate(dit, vae, JOB, Parallel(), thresh=0.2)
    assert tea.skipped_calls >= JOB.steps // 2 and tea.transformer_calls + tea.skipped_calls == 2 * JOB.steps
    diff = (cached.float() - plain.float()).abs()
    assert 0 < diff.mean() < 2.0 and diff.max() < 64, (diff.mean(), diff.max())  # changed, by a bounded amount
    other, _ = generate(dit, vae, VideoJob(**{**JOB.__dict__, "prompt_ids": [100, 200]}), Parallel())
    assert (other.float() - plain.float()).abs().mean() > 0.5  # the prompt conditions the video


def _keep_frames(engine: VideoEngine, path: str) -> None:
    """Save the frames each job makes before they are encoded: MP4 is lossy, and frames one level apart can
    come out of the encoder 17 levels apart (av 18)."""
    generate_frames = engine._generate

    def kept(*args, **kwargs):
        frames, stats = generate_frames(*args, **kwargs)
        np.save(path, frames)
        return frames, stats
    engine._generate = kept


def _rank(rank: int, world: int, port: int, model: str, spec: dict, out: str, device_type: str = "cpu") -> None:
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    if device_type == "cuda":  # NCCL, each rank on its own GPU, as a worker's ranks run
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device(device))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        engine = VideoEngine(model, DiffusionSpec(**spec), device=device, rank=rank, world=world)
        engine.load()
        _keep_frames(engine, f"{out}.frames.{rank}.npy")
        if rank == 0:
            result = engine._run(_request(out + ".mp4"), lambda done, total: None, threading.Event())
            engine._broadcast_job(None)
            record = {"transformer_calls": result.transformer_calls}
        else:
            engine.follow()
            record = {}
        record.update(all_to_all=engine.par.all_to_all_calls, cfg_rank=engine.par.cfg_rank,
                      ulysses_rank=engine.par.ulysses_rank, backend=dist.get_backend(),
                      device=str(next(engine.dit.parameters()).device))
        with open(f"{out}.{rank}", "w") as handle:
            json.dump(record, handle)
    finally:
        dist.destroy_process_group()


def _request(path: str) -> VideoRequest:
    return VideoRequest(video_id="v", prompt_ids=JOB.prompt_ids, negative_ids=JOB.negative_ids, height=JOB.height,
                        width=JOB.width, frames=JOB.frames, steps=JOB.steps, guidance=JOB.guidance, seed=JOB.seed,
                        fps=8, output_path=path)


@pytest.mark.unit
@pytest.mark.parametrize("spec", [{"dit_cfg_size": 2}, {"dit_ulysses_size": 2},
                                  {"dit_cfg_size": 2, "dit_ulysses_size": 2}])
def test_cfg_and_ulysses_parallel_ranks_give_the_single_rank_video(video_model, tmp_path, spec):
    _check_parallel(video_model, tmp_path, spec, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("spec", [{"dit_cfg_size": 2}, {"dit_ulysses_size": 2}])
def test_cfg_and_ulysses_over_nccl_on_two_gpus_give_the_single_gpu_video(video_model, tmp_path, spec):
    _check_parallel(video_model, tmp_path, spec, "cuda")


def _check_parallel(video_model, tmp_path, spec: dict, device_type: str) -> None:
    one_device = "cuda:0" if device_type == "cuda" else "cpu"
    single = VideoEngine(str(video_model), DiffusionSpec(), device=one_device)
    single.load()
    _keep_frames(single, str(tmp_path / "one.frames.npy"))
    one = single._run(_request(str(tmp_path / "one.mp4")), lambda d, t: None, threading.Event())
    world = spec.get("dit_cfg_size", 1) * spec.get("dit_ulysses_size", 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "ranks")
    torch.multiprocessing.spawn(_rank, args=(world, port, str(video_model), spec, out, device_type), nprocs=world)
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(world)]
    assert [r["backend"] for r in ranks] == ["nccl" if device_type == "cuda" else "gloo"] * world
    assert [r["device"] for r in ranks] == ([f"cuda:{i}" for i in range(world)] if device_type == "cuda"
                                           else ["cpu"] * world)
    want, fps = read_mp4(tmp_path / "one.mp4")
    got, got_fps = read_mp4(tmp_path / "ranks.mp4")
    assert got.shape == want.shape == (8, 64, 64, 3) and got_fps == fps == 8
    # fp32: the same frames (the encoded files are not compared pixel by pixel: the encoder moves pixels of
    # inputs one level apart by more than a level, 0.2-0.4 on average with av 18)
    frames = np.load(tmp_path / "one.frames.npy").astype(int)
    assert np.abs(np.load(f"{out}.frames.0.npy").astype(int) - frames).max() <= 1
    if spec.get("dit_cfg_size") == 2:  # each rank ran one branch of the guidance
        assert ranks[0]["transformer_calls"] == JOB.steps == one.transformer_calls // 2
        assert sorted(r["cfg_rank"] for r in ranks) == sorted([0, 1] * (world // 2))
    if spec.get("dit_ulysses_size") == 2:  # tokens crossed ranks around every self-attention
        assert all(r["all_to_all"] >= 2 * JOB.steps for r in ranks)
    else:
        assert all(r["all_to_all"] == 0 for r in ranks)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@CUDA
def test_the_video_dit_on_a_gpu_gives_the_cpu_video(video_model, tmp_path):
    import time

    _, dit, vae = load_tiny_video(video_model)
    want, _ = generate(dit, vae, JOB, Parallel())
    engine = VideoEngine(str(video_model), DiffusionSpec(), device="cuda:0")
    engine.load()
    assert next(engine.dit.parameters()).device.type == "cuda"
    t0 = time.perf_counter()
    result = engine._run(_request(str(tmp_path / "gpu.mp4")), lambda d, t: None, threading.Event())
    print(f"tiny video DiT on {torch.cuda.get_device_name(0)}: {JOB.steps} steps x 2 branches in "
          f"{time.perf_counter() - t0:.3f} s (first call, warm-up included)")
    got, _ = engine._generate(JOB, lambda d, t: None, lambda: False)
    assert np.abs(got.astype(int) - want.numpy().astype(int)).max() <= 2  # fp32 on another device: rounding
    frames, fps = read_mp4(tmp_path / "gpu.mp4")
    assert frames.shape == (8, 64, 64, 3) and result.transformer_calls == 2 * JOB.steps
