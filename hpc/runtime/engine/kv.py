"""KV-cache blocks moved from a prefill worker to a decode worker: tensor <-> bytes (any two machines), or a
CUDA IPC handle (same node, both on GPUs: the decode side copies device to device, no host round trip). No
pickle either way. NIXL, the third way, is in kv_nixl.py."""

from __future__ import annotations

import torch

from hpc.runtime.serve.wire import CudaIpc, KvMeta

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
    """A CUDA tensor as an IPC handle; the caller keeps `t` alive until the other side released it."""
    storage = t.untyped_storage()
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return KvMeta(shape=list(t.shape), dtype=str(t.dtype),
                  ipc=CudaIpc(device=int(device), handle=bytes(handle), size_bytes=int(size_bytes),
                              offset_bytes=int(offset_bytes), ref_counter_handle=bytes(ref_handle),
                              ref_counter_offset=int(ref_offset), event_handle=bytes(event_handle or b""),
                              event_sync_required=bool(event_sync), tensor_offset=t.storage_offset(),
                              stride=list(t.stride())))


def open_shared(meta: KvMeta) -> torch.Tensor:
    """The other process's tensor (on its device), opened from the IPC handle: copy it before releasing."""
    ipc, dtype = meta.ipc, dtype_of(meta)
    if ipc is None:
        raise ValueError("this KV description carries bytes, not a CUDA IPC handle")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(ipc.device, ipc.handle, ipc.size_bytes, ipc.offset_bytes,
                                                    ipc.ref_counter_handle, ipc.ref_counter_offset,
                                                    ipc.event_handle or None, ipc.event_sync_required)
    return torch.empty(0, dtype=dtype, device=f"cuda:{ipc.device}").set_(storage, ipc.tensor_offset, meta.shape,
                                                                         ipc.stride)


def copy_shared(meta: KvMeta, device: str) -> torch.Tensor:
    """Open the other process's KV and copy it onto `device` (peer to peer across GPUs), finished on return —
    the owner may free it as soon as this returns."""
    with torch.cuda.device(torch.device(device)):
        kv = open_shared(meta).to(device, copy=True)
        torch.cuda.current_stream().synchronize()
    return kv
