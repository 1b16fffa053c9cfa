"""Images for multimodal requests: URL, data URL or a local path inside `allowed_local_media_path`."""

from __future__ import annotations

import base64
import io
import os
import urllib.request
from pathlib import Path


class MediaError(ValueError):
    """The request's image cannot be used (a 400 for the client)."""


def read_image_bytes(ref: str, *, allowed_local_path: str | None, max_file_size_mb: float) -> bytes:
    limit = int(max_file_size_mb * 1024 * 1024)
    if ref.startswith("data:"):
        header, _, data = ref.partition(",")
        raw = base64.b64decode(data) if ";base64" in header else data.encode()
        if len(raw) > limit:
            raise MediaError(f"image exceeds max_file_size_mb ({max_file_size_mb})")
        return raw
    if ref.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(ref, timeout=10) as resp:
                declared = resp.headers.get("content-length")
                if declared and int(declared) > limit:
                    raise MediaError(f"image at {ref} is larger than max_file_size_mb ({max_file_size_mb})")
                data = resp.read(limit + 1)  # stop reading as soon as the limit is passed
        except OSError as exc:
            raise MediaError(f"cannot download {ref}: {exc}") from None
        if len(data) > limit:
            raise MediaError(f"image at {ref} is larger than max_file_size_mb ({max_file_size_mb})")
        return data
    path_text = ref.removeprefix("file://")
    if allowed_local_path is None:
        raise MediaError("local image paths are disabled (set runtime.allowed_local_media_path in the recipe)")
    root = Path(allowed_local_path).expanduser().resolve()
    candidate = Path(path_text)
    if ".." in candidate.parts:
        raise MediaError("image path must not contain '..'")
    if not candidate.is_absolute():
        candidate = root / candidate
    resolved = candidate.resolve()  # follows symlinks, so one pointing outside is caught below
    if resolved != root and root not in resolved.parents:
        raise MediaError(f"image path is outside allowed_local_media_path ({root})")
    if not resolved.is_file():
        raise MediaError(f"image not found: {path_text}")
    if os.path.getsize(resolved) > limit:
        raise MediaError(f"image is larger than max_file_size_mb ({max_file_size_mb})")
    return resolved.read_bytes()


def to_pixels(data: bytes, size: int):
    """Bytes of any PIL-readable image -> float tensor [3, size, size] in [0, 1]."""
    import torch
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data)).convert("RGB").resize((size, size))
    except (UnidentifiedImageError, OSError) as exc:
        raise MediaError(f"not a readable image: {exc}") from None
    raw = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).reshape(size, size, 3)
    return raw.permute(2, 0, 1).float() / 255.0
