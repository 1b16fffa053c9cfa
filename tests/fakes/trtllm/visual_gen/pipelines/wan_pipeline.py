"""Fake `ditWanPipeline` (visual_gen.pipelines.wan_pipeline), modelled on how Dynamo calls it
(components/src/dynamo/trtllm_diffusion/engine.py) and on the diffusers Wan pipeline it follows
(huggingface/diffusers src/diffusers/pipelines/wan/pipeline_wan.py): `from_pretrained(path, torch_dtype, **configs)`
after `setup_configs`; `__call__(prompt, negative_prompt, height, width, num_frames, num_inference_steps,
guidance_scale, generator, output_type="np", callback_on_step_end=None)` returns an output whose `.frames[0]` is
[num_frames, height, width, 3] float32 in [0, 1]; `callback_on_step_end(pipe, i, t, callback_kwargs)` runs after
every step and must return the kwargs; `pipe._interrupt = True` skips the remaining steps (diffusers' interrupt).
Strict: sizes must be multiples of 16 and num_frames 1 + a multiple of 4 (Wan's VAE), output_type "np" only."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import visual_gen


class ditWanPipeline:  # noqa: N801 (the upstream name)
    def __init__(self, path: str, dtype, configs: dict) -> None:
        self.path, self.dtype, self.configs = path, dtype, configs
        self._interrupt = False
        self.calls: list[dict] = []

    @classmethod
    def from_pretrained(cls, path: str, torch_dtype=None, **configs) -> "ditWanPipeline":
        if not visual_gen.CONFIGS:
            raise RuntimeError("setup_configs() must run before from_pretrained()")
        visual_gen.check_sections(configs)
        if configs != visual_gen.CONFIGS:
            raise ValueError("from_pretrained() configs differ from setup_configs()")
        return cls(path, torch_dtype, configs)

    def __call__(self, prompt: str, negative_prompt: str | None = None, height: int = 480, width: int = 832,
                 num_frames: int = 81, num_inference_steps: int = 50, guidance_scale: float = 5.0,
                 generator=None, output_type: str = "np", callback_on_step_end=None):
        if output_type != "np":
            raise ValueError(f"output_type {output_type!r}: this fake models 'np'")
        if height % 16 or width % 16 or (num_frames - 1) % 4:
            raise ValueError(f"{width}x{height}x{num_frames}: sizes must be multiples of 16, frames 4k+1")
        self._interrupt = False
        self.calls.append({"prompt": prompt, "negative_prompt": negative_prompt, "steps": num_inference_steps})
        seed = int(generator.initial_seed()) if generator is not None else 0
        rng = np.random.default_rng([seed, len(prompt)])
        frames = rng.random((num_frames, height, width, 3), dtype=np.float32)
        for i in range(num_inference_steps):
            if self._interrupt:  # diffusers: `if self.interrupt: continue` for the remaining steps
                continue
            if callback_on_step_end is not None:
                kwargs = callback_on_step_end(self, i, 1000 - i, {})
                if not isinstance(kwargs, dict):
                    raise TypeError("callback_on_step_end must return the callback kwargs")
        return SimpleNamespace(frames=[frames])
