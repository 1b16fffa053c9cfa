"""The TensorRT-LLM video engine (visual_gen) against its strict fake (tests/fakes/trtllm/visual_gen): the recipe's
diffusion flags become visual_gen's configuration, a request becomes one pipeline call, the frames an MP4,
progress and cancellation go through the pipeline's step callback."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from hpc.runtime.engine.video.mp4 import read_mp4
from hpc.runtime.engine.video.pipeline import Cancelled
from hpc.runtime.serve.wire import VideoRequest
from hpc.spec.diffusion import DiffusionSpec

pytestmark = pytest.mark.unit
FAKE = Path(__file__).resolve().parents[1] / "fakes" / "trtllm"


@pytest.fixture(autouse=True)
def fake_visual_gen():
    sys.path.insert(0, str(FAKE))
    yield
    sys.path.remove(str(FAKE))
    for name in [m for m in sys.modules if m == "visual_gen" or m.startswith("visual_gen.")]:
        del sys.modules[name]


def _engine(**flags):
    from hpc.runtime.engine.video.trtllm_video import TrtllmVideoEngine

    engine = TrtllmVideoEngine("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", DiffusionSpec(**flags))
    engine.load()
    return engine


def _request(path: Path, steps: int = 6) -> VideoRequest:
    return VideoRequest(video_id="v1", prompt_ids=[1], height=64, width=96, frames=9, steps=steps, guidance=5.0,
                        seed=3, fps=16, output_path=str(path), prompt="a red fox", negative_prompt="blurry")


def test_flags_become_visual_gen_configs_and_a_request_one_pipeline_call(tmp_path):
    import visual_gen

    engine = _engine(enable_teacache=True, teacache_thresh=0.3, dit_cfg_size=2, dit_ulysses_size=4,
                     attn_type="sage-attn", torch_compile_mode="max-autotune")
    assert visual_gen.CONFIGS["parallel"]["dit_cfg_size"] == 2 and visual_gen.CONFIGS["parallel"]["dit_ulysses_size"] == 4
    assert visual_gen.CONFIGS["teacache"]["teacache_thresh"] == 0.3 and visual_gen.CONFIGS["teacache"]["enable_teacache"]
    assert visual_gen.CONFIGS["attn"]["type"] == "sage-attn"
    assert visual_gen.CONFIGS["pipeline"]["torch_compile_mode"] == "max-autotune"
    steps: list[int] = []
    result = engine._run(_request(tmp_path / "v1.mp4"), lambda done, total: steps.append(done), threading.Event())
    assert steps == [1, 2, 3, 4, 5, 6] and result.frames == 9 and (result.width, result.height) == (96, 64)
    frames, fps = read_mp4(tmp_path / "v1.mp4")
    assert frames.shape == (9, 64, 96, 3) and fps == 16
    assert engine.pipe.calls == [{"prompt": "a red fox", "negative_prompt": "blurry", "steps": 6}]


def test_cancelling_interrupts_the_pipeline_at_the_next_step(tmp_path):
    engine = _engine()
    cancel = threading.Event()

    def on_step(done: int, total: int) -> None:
        if done == 2:
            cancel.set()
    with pytest.raises(Cancelled):
        engine._run(_request(tmp_path / "v2.mp4", steps=20), on_step, cancel)
    assert engine.counters["cancelled"] == 1 and not (tmp_path / "v2.mp4").exists()


def test_a_wrong_configuration_section_fails_like_upstream():
    import visual_gen

    with pytest.raises(KeyError):
        visual_gen.setup_configs(pipeline={}, attn={"type": "default"}, linear={}, parallel={}, teacache={})
