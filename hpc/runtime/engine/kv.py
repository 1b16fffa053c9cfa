"""KV-cache blocks moved from a prefill worker to a decode worker: tensor <-> bytes, no pickle."""

from __future__ import annotations

import torch

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def pack(t: torch.Tensor) -> tuple[dict, bytes]:
    t = t.detach().contiguous().cpu()
    meta = {"shape": list(t.shape), "dtype": str(t.dtype)}
    return meta, t.view(torch.uint8).numpy().tobytes()


def unpack(meta: dict, data: bytes) -> torch.Tensor:
    dtype = _DTYPES[meta["dtype"]]
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(meta["shape"])
