"""Choose and build the engine for a worker from the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hpc.manifest import Manifest
from hpc.runtime.engine.types import DisaggregationMode, Engine
from hpc.spec.recipe import Backend

if TYPE_CHECKING:
    from hpc.runtime.engine.torch.engine import TorchEngine


def build_engine(manifest: Manifest, role: str, *, self_address: str, tp=None,
                 fetch_kv: Callable[..., Any] | None = None, device: str | None = None,
                 group: str | None = None) -> Engine:
    """`group`: the worker's pool when its role has pools (WorkerPlan.group), else the role."""
    recipe = manifest.recipe
    mode = DisaggregationMode(role)
    args = manifest.engine_args[group or role]
    if recipe.modality == "video_diffusion":
        from hpc.runtime.engine.video.engine import VideoEngine

        rank, world = (tp.rank, tp.size) if tp is not None else (0, 1)
        engine_class = VideoEngine
        if recipe.backend is Backend.TRTLLM:
            from hpc.runtime.engine.video.trtllm_video import TrtllmVideoEngine

            engine_class = TrtllmVideoEngine
        elif recipe.backend is not Backend.TORCH:
            raise RuntimeError("video diffusion runs on the torch or trtllm backend, not mock")
        assert recipe.diffusion is not None, "the recipe's validation gives a video recipe its diffusion block"
        return engine_class(recipe.model.path, recipe.diffusion, device=device or "cpu", rank=rank, world=world)
    if recipe.backend is Backend.MOCK:
        from hpc.runtime.engine.mock import MockEngine

        return MockEngine(mode, recipe.mock.prefill_delay_ms, recipe.mock.per_token_delay_ms, self_address)
    if recipe.backend is Backend.TORCH:
        return build_torch_engine(manifest, role, self_address=self_address, tp=tp, fetch_kv=fetch_kv, device=device,
                                  group=group)
    from hpc.runtime.engine.trtllm import TrtllmEngine
    from hpc.runtime.worker.media import read_image_bytes

    def load_image_bytes(ref: str) -> bytes:
        return read_image_bytes(ref, allowed_local_path=recipe.runtime.allowed_local_media_path,
                                max_file_size_mb=recipe.runtime.max_file_size_mb,
                                allowed_hosts=recipe.runtime.media_allowed_hosts)

    return TrtllmEngine(recipe.model.path, mode, args, self_address=self_address,
                        load_image_bytes=load_image_bytes if recipe.model.multimodal else None)


def build_torch_engine(manifest: Manifest, role: str, *, self_address: str, tp=None,
                       fetch_kv: Callable[..., Any] | None = None, device: str | None = None,
                       group: str | None = None) -> "TorchEngine":
    """The torch reference engine of a text worker (an engine process holds no other)."""
    from hpc.runtime.engine.torch.engine import TorchEngine

    recipe = manifest.recipe
    spec = recipe.roles.spec(group or role)
    return TorchEngine(Path(recipe.model.path), DisaggregationMode(role), manifest.engine_args[group or role],
                       device=device, tp=tp, fetch_kv=fetch_kv, self_address=self_address,
                       canned_completion=recipe.model.canned_completion, pipeline=spec.pipeline_parallel_size > 1,
                       expert_parallel=spec.expert_parallel_size > 1, switches=recipe.torch_engine)
