"""KV-cache blocks moved from a prefill worker to a decode worker: tensor <-> bytes, no pickle."""

from __future__ import annotations

import torch

from hpc.runtime.serve.wire import KvMeta

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def pack(t: torch.Tensor) -> tuple[KvMeta, bytes]:
    t = t.detach().contiguous().cpu()
    return KvMeta(shape=list(t.shape), dtype=str(t.dtype)), t.view(torch.uint8).numpy().tobytes()


def unpack(meta: KvMeta, data: bytes) -> torch.Tensor:
    dtype = _DTYPES.get(meta.dtype)
    if dtype is None:
        raise ValueError(f"KV dtype {meta.dtype!r} is not one of {sorted(_DTYPES)}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(meta.shape)
