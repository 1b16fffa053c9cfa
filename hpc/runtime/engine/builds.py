"""The random-weight models hpc generates (`model.generate`, `hpc model KIND`), by kind, built once per directory
by the job's first process to need one."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

from hpc.model.generated import LLAMA_8B_SHAPE, build_place_problem
from hpc.runtime.engine.models.tiny import build_shaped, build_tiny

KINDS = ("tiny", "tiny-multimodal", "tiny-moe", "tiny-video", "llama-8b-shape")


def build_kind(out_dir: Path, kind: str) -> Path:
    """One of KINDS: the dense tiny model, with a vision encoder, or with sparse experts; or the video DiT."""
    if kind == "tiny-video":
        from hpc.runtime.engine.video.dit import build_tiny_video

        return build_tiny_video(out_dir)
    if kind == "llama-8b-shape":
        return build_shaped(out_dir, LLAMA_8B_SHAPE)
    return build_tiny(out_dir, multimodal=kind == "tiny-multimodal", moe=kind == "tiny-moe")


def ensure_model(path: str, kind: str | None, apart: bool = False) -> Path:
    """The model directory, built by the job's first process to get here when the recipe asks for a generated
    model that is missing. Every worker rank and the frontend call it; an exclusive lock inside the directory
    makes one build while the others wait (the directory itself is what a container mounts). `apart`: build in a
    child process (`hpc model`), for a caller that must not import torch (a frontend)."""
    model_dir = Path(path).expanduser()
    if not kind or (model_dir / "config.json").is_file():
        return model_dir
    refused = build_place_problem(path)
    if refused:  # the job's side of the launcher's check (a cluster's nodes)
        raise RuntimeError(refused)
    model_dir.mkdir(parents=True, exist_ok=True)
    with open(model_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (model_dir / "config.json").is_file():
            if apart:
                subprocess.run([sys.executable, "-m", "hpc", "model", kind, "--out", str(model_dir)], check=True,
                               stdout=subprocess.DEVNULL)
            else:
                build_kind(model_dir, kind)
    return model_dir
