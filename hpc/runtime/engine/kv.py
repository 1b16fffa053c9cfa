"""KV-cache blocks moved from a prefill worker to a decode worker: tensor <-> bytes (any two machines), or a
CUDA IPC handle (same node, both on GPUs: the decode side copies device to device, no host round trip). No
pickle either way. NIXL, the third way, is in kv_nixl.py."""

from __future__ import annotations

import torch

from hpc.runtime.engine.cuda_ipc import OpenAllocations, export
from hpc.runtime.serve.wire import KvMeta

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def pack(t: torch.Tensor) -> tuple[KvMeta, memoryview]:
    """The KV's bytes without a copy on the host (the view keeps the tensor alive until it is sent)."""
    t = t.detach().contiguous().cpu()
    return KvMeta(shape=list(t.shape), dtype=str(t.dtype)), memoryview(t.view(torch.uint8).reshape(-1).numpy())


def dtype_of(meta: KvMeta) -> torch.dtype:
    dtype = _DTYPES.get(meta.dtype)
    if dtype is None:
        raise ValueError(f"KV dtype {meta.dtype!r} is not one of {sorted(_DTYPES)}")
    return dtype


def unpack(meta: KvMeta, data: bytes | bytearray) -> torch.Tensor:
    # A large payload arrives as a bytearray of its own (rpc._read_raw): the tensor may take it over.
    raw = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
    return raw.view(dtype_of(meta)).reshape(meta.shape)


def share(t: torch.Tensor) -> KvMeta:
    """A CUDA tensor (complete: its producer synchronised) as an IPC location; the caller keeps `t` alive until the
    other side released it."""
    t = t.contiguous()
    return KvMeta(shape=list(t.shape), dtype=str(t.dtype), ipc=export(t))


def copy_shared(meta: KvMeta, device: str, opened: OpenAllocations) -> torch.Tensor:
    """The other process's KV copied onto `device` (peer to peer across GPUs), finished on return — the owner may
    free it as soon as this returns. `opened` keeps the owner's allocations open for the next handoffs."""
    if meta.ipc is None:
        raise ValueError("this KV description carries bytes, not a CUDA IPC location")
    target = torch.device(device)
    with torch.cuda.device(target):
        raw = opened.view(meta.ipc, target)
        kv = raw.view(dtype_of(meta)).reshape(meta.shape).to(target, copy=True)
        torch.cuda.current_stream(target).synchronize()
    return kv
