"""Frames to an MP4 (H.264, yuv420p) and back, through PyAV (FFmpeg's libraries, a dependency of the serving
extra)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np


def write_mp4(frames: np.ndarray, fps: int, path: Path) -> int:
    """frames [F, H, W, 3] uint8 -> `path` (written under a temporary name, then renamed); its size in bytes."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with av.open(str(partial), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    partial.replace(path)
    return path.stat().st_size


def read_mp4(path: Path) -> tuple[np.ndarray, float]:
    """(frames [F, H, W, 3] uint8, frames per second) of an MP4: what a player would show."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)
