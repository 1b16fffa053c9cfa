"""Video diffusion on TensorRT-LLM's visual generation (`visual_gen`), the path users run on real clusters.

Written against the API as Dynamo's TensorRT-LLM video worker drives it (components/src/dynamo/trtllm_diffusion/
engine.py): `visual_gen.setup_configs(**dit_configs)` once, `ditWanPipeline.from_pretrained(path,
torch_dtype=bfloat16, **dit_configs)`, then `pipe(prompt=..., negative_prompt=..., height=..., width=...,
num_frames=..., num_inference_steps=..., guidance_scale=..., generator=..., output_type="np")` whose `.frames[0]`
is the video. Progress and cancellation use diffusers' pipeline callbacks (`callback_on_step_end`; setting
`pipe._interrupt` stops the loop: diffusers' "Interrupt the Diffusion Process") when the pipeline takes them.
Imported lazily: hpc's launcher and CPU machines never need it. Every rank of the worker runs the pipeline with
the same job (VideoEngine broadcasts it); visual_gen's own parallel groups split the work by the dit_* sizes.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from hpc.runtime.engine.video.engine import VideoEngine
from hpc.runtime.engine.video.pipeline import Cancelled, Stats, VideoJob
from hpc.spec.diffusion import DiffusionSpec


def dit_configs(spec: DiffusionSpec, model_path: str) -> dict[str, Any]:
    """The recipe's diffusion flags as visual_gen's configuration sections."""
    return {
        "pipeline": {"enable_torch_compile": not spec.disable_torch_compile,
                     # Wan 2.2 has a second (low-noise) transformer that is compiled too
                     "torch_compile_models": "transformer,transformer_2" if "Wan2.2" in model_path else "transformer",
                     "torch_compile_mode": spec.torch_compile_mode, "fuse_qkv": True},
        "attn": {"type": spec.attn_type},
        "linear": {"type": spec.linear_type, "recipe": "dynamic"},
        "parallel": {"disable_parallel_vae": False, "parallel_vae_split_dim": "width",
                     "dit_dp_size": spec.dit_dp_size, "dit_tp_size": spec.dit_tp_size,
                     "dit_ulysses_size": spec.dit_ulysses_size, "dit_ring_size": spec.dit_ring_size,
                     "dit_cp_size": 1, "dit_cfg_size": spec.dit_cfg_size, "dit_fsdp_size": spec.dit_fsdp_size,
                     "t5_fsdp_size": 1},
        "teacache": {"enable_teacache": spec.enable_teacache, "use_ret_steps": True,
                     "teacache_thresh": spec.thresh if spec.enable_teacache else 0.2, "ret_steps": 0,
                     "cutoff_steps": spec.default_num_inference_steps},
    }


class TrtllmVideoEngine(VideoEngine):
    def load(self) -> None:
        import torch
        from visual_gen import setup_configs
        from visual_gen.pipelines.wan_pipeline import ditWanPipeline

        configs = dit_configs(self.spec, str(self.model_path))
        setup_configs(**configs)  # global, before the pipeline loads
        self.pipe = ditWanPipeline.from_pretrained(str(self.model_path), torch_dtype=torch.bfloat16, **configs)
        self._takes_callback = "callback_on_step_end" in inspect.signature(self.pipe.__call__).parameters

    def _generate(self, job: VideoJob, on_step, cancelled) -> tuple[np.ndarray, Stats]:
        import torch

        stats = Stats()
        stopped = False
        extra: dict[str, Any] = {}
        if self._takes_callback:
            def step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
                nonlocal stopped
                stats.steps_done = step + 1
                on_step(step + 1, job.steps)
                if cancelled():
                    stopped = True
                    pipe._interrupt = True
                return callback_kwargs
            extra["callback_on_step_end"] = step_end
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.no_grad():
            result = self.pipe(prompt=job.prompt, negative_prompt=job.negative_prompt or None, height=job.height,
                               width=job.width, num_frames=job.frames, num_inference_steps=job.steps,
                               guidance_scale=job.guidance, generator=torch.Generator(device=device).manual_seed(
                                   job.seed), output_type="np", **extra)
        if stopped:
            raise Cancelled()
        frames = np.asarray(result.frames[0])
        if frames.dtype != np.uint8:  # diffusers' "np" output: floats in [0, 1]
            frames = (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
        stats.steps_done = job.steps
        stats.transformer_calls = job.steps  # visual_gen does not report TeaCache's skips
        return frames, stats
