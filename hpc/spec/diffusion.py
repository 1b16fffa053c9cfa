"""Video diffusion as a served modality (seed 004): the worker's diffusion flags, typed and strict.

Every flag of seed 004's list, with the defaults Dynamo's TensorRT-LLM video-diffusion worker gives them
(components/src/dynamo/trtllm_diffusion/args.py): 480 x 832, 81 frames, 50 steps, guidance 5.0, TeaCache off
(threshold 0.2 when on), attention/linear/torch.compile choices as its argparse lists them, every dit_* size 1.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field, model_validator

from hpc.spec.base import SingleLine, StrictModel


class DiffusionSpec(StrictModel):
    output_dir: SingleLine | None = Field(
        default=None, description="where videos are written (url responses); default: the run directory's videos/")
    default_height: int = Field(default=480, ge=8, le=8192)
    default_width: int = Field(default=832, ge=8, le=8192)
    default_num_frames: int = Field(default=81, ge=1, le=4096)
    default_num_inference_steps: int = Field(default=50, ge=1, le=1000)
    default_guidance_scale: float = Field(default=5.0, ge=0, le=100, allow_inf_nan=False)
    default_fps: int = Field(default=16, ge=1, le=240,
        description="frames per second of the MP4 when a request gives none")
    enable_teacache: bool = False
    teacache_thresh: float | None = Field(
        default=None, ge=0, le=10, allow_inf_nan=False,
        description="skip a transformer call while the modulated input changed less than this (relative L1, "
                    "accumulated); only with enable_teacache (0.2 when it is on and this is unset)")
    attn_type: Literal["default", "sage-attn", "sparse-videogen", "sparse-videogen2"] = "default"
    linear_type: Literal["default", "trtllm-fp8-blockwise", "trtllm-fp8-per-tensor", "trtllm-nvfp4"] = "default"
    disable_torch_compile: bool = False
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    dit_dp_size: int = Field(default=1, ge=1, le=1024)
    dit_tp_size: int = Field(default=1, ge=1, le=1024)
    dit_ulysses_size: int = Field(default=1, ge=1, le=1024)
    dit_ring_size: int = Field(default=1, ge=1, le=1024)
    dit_cfg_size: Literal[1, 2] = Field(default=1, description="2: the conditional and unconditional branches of "
                                                               "classifier-free guidance on two ranks")
    dit_fsdp_size: int = Field(default=1, ge=1, le=1024, description="weight sharding within the ranks above")
    enable_async_cpu_offload: bool = False

    @model_validator(mode="after")
    def _teacache(self) -> "DiffusionSpec":
        if self.teacache_thresh is not None and not self.enable_teacache:
            raise ValueError("teacache_thresh is set but enable_teacache is false; turn TeaCache on or remove "
                             "the threshold")
        return self

    @property
    def thresh(self) -> float:
        """The TeaCache threshold in force (0: no step is skipped)."""
        if not self.enable_teacache:
            return 0.0
        return 0.2 if self.teacache_thresh is None else self.teacache_thresh

    @property
    def ranks(self) -> int:
        """GPUs (ranks) one worker spans: the product of the parallel sizes (FSDP shards within them)."""
        return self.dit_dp_size * self.dit_tp_size * self.dit_ulysses_size * self.dit_ring_size * self.dit_cfg_size


class VideoModelFacts(NamedTuple):
    """What a request's sizes must fit: height and width are multiples of `spatial` (VAE x patch), the frame
    count is 1 + a multiple of `temporal` (the VAE's time compression), at most `max_frames`."""

    spatial: int
    temporal: int
    max_frames: int


TINY_VIDEO = VideoModelFacts(spatial=16, temporal=1, max_frames=32)  # hpc's random-weight DiT (model.generate)
WAN = VideoModelFacts(spatial=16, temporal=4, max_frames=129)  # Wan 2.x: VAE 8 x 8 x 4, patch 1 x 2 x 2


def model_facts(generate: str | None) -> VideoModelFacts:
    return TINY_VIDEO if generate == "tiny-video" else WAN


def check_sizes(facts: VideoModelFacts, height: int, width: int, frames: int) -> str | None:
    """What is wrong with a video size for this model, in words, or None."""
    if height % facts.spatial or width % facts.spatial:
        return f"{width}x{height} is not a multiple of {facts.spatial} in both sides"
    if frames > facts.max_frames:
        return f"{frames} frames is above the model's limit of {facts.max_frames}"
    if (frames - 1) % facts.temporal:
        return f"{frames} frames is not 1 + a multiple of {facts.temporal}"
    return None


# The reference engine runs classifier-free-guidance and Ulysses sequence parallelism; the others are TensorRT-LLM's.
TORCH_PARALLEL = ("dit_cfg_size", "dit_ulysses_size")
