"""CUDA IPC through the driver API, for the same-node KV handoff: the prefill shares the allocation its KV lies in
(handle + offset), the decode side opens each allocation once, keeps it open and copies with the driver.

Why not torch's `storage._share_cuda_`: every handoff then opened and closed the allocation's mapping
(cuIpcOpenMemHandle/cuIpcCloseMemHandle; the whole fetch of a 262 MB KV on an H100 took 1.3-1.8 ms, now 0.9),
and keeping the opened storage alive to avoid that would keep torch's cross-process reference count up, so the
prefill's allocator could never reuse the block. Here lifetime is hpc's own protocol instead: the prefill keeps
the KV until the decode side's ReleaseKv, and its caching allocator hands the same allocation to later KVs, which
the decode side then finds already open.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import OrderedDict

import torch

from hpc.runtime.serve.wire import CudaIpc

_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: a decode on another GPU of the node
OPEN_ALLOCATIONS = 8  # per decode worker; the prefill's caching allocator reuses a few large blocks
# An allocation the prefill freed (empty_cache, or its allocator's retry after an out-of-memory) stays in GPU memory
# while it is open here: one not used for this long is closed at the next handoff.
IDLE_CLOSE_S = 30.0


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # CUipcMemHandle (bytes, NULs included: not c_char)

    @classmethod
    def of(cls, data: bytes) -> "_Handle":
        if len(data) != 64:
            raise ValueError(f"a CUDA IPC handle has 64 bytes, not {len(data)}")
        return cls.from_buffer_copy(data)


_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE


class _Memcpy3D(ctypes.Structure):
    """CUDA_MEMCPY3D (cuda.h), for cuMemcpy3DAsync_v2: a run of rows of one pitch, in slices of another, on both
    sides — a KV's [layers x 2, heads, tokens x head_dim] into one slot of the cache's [layers x 2, slots x heads,
    max_len x head_dim] in one call."""
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcZ", ctypes.c_size_t),
                ("srcLOD", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p), ("reserved0", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("srcHeight", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstZ", ctypes.c_size_t),
                ("dstLOD", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p), ("reserved1", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t), ("dstHeight", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


class _Driver:
    """The few libcuda calls used here (the driver is on every GPU node; nothing to install)."""

    _lib = None
    _lock = threading.Lock()

    @classmethod
    def lib(cls):
        with cls._lock:
            if cls._lib is None:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                        ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
                lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
                lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
                lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
                lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
                lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
                lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
                lib.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                                     ctypes.c_void_p]
                lib.cuMemcpy3DAsync_v2.argtypes = [ctypes.POINTER(_Memcpy3D), ctypes.c_void_p]
                cls._lib = lib
        return cls._lib

    _contexts: dict[int, ctypes.c_void_p] = {}

    @classmethod
    def use(cls, device: torch.device):
        """Make `device`'s primary context (torch's) current on this thread: a worker thread that never made a
        runtime call has none, and the driver calls below need one. Returns the library."""
        lib = cls.lib()
        index = device.index or 0
        with cls._lock:
            ctx = cls._contexts.get(index)
            if ctx is None:
                ordinal, ctx = ctypes.c_int(), ctypes.c_void_p()
                cls.check(lib.cuDeviceGet(ctypes.byref(ordinal), index), "cuDeviceGet")
                cls.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal), "cuDevicePrimaryCtxRetain")
                cls._contexts[index] = ctx
        cls.check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        return lib

    @classmethod
    def check(cls, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            cls.lib().cuGetErrorString(result, ctypes.byref(text))
            raise RuntimeError(f"{what} failed: {(text.value or b'').decode() or result}")


def export(t: torch.Tensor) -> CudaIpc:
    """Where `t` (contiguous, on a GPU, complete) lies: its allocation's IPC handle and the offset into it."""
    if not (t.is_cuda and t.is_contiguous()):
        raise ValueError("CUDA IPC shares a contiguous tensor on a GPU")
    lib = _Driver.use(t.device)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _Driver.check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), t.data_ptr()),
                  "cuMemGetAddressRange")
    handle = _Handle()
    _Driver.check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
    return CudaIpc(device=t.device.index or 0, handle=bytes(handle.reserved), allocation_bytes=size.value,
                   offset_bytes=t.data_ptr() - base.value, size_bytes=t.numel() * t.element_size())


class OpenAllocations:
    """The other processes' allocations this process has open, least recently used closed first."""

    def __init__(self, limit: int = OPEN_ALLOCATIONS) -> None:
        self.limit = limit
        self._open: OrderedDict[tuple[int, bytes], int] = OrderedDict()  # (device, handle) -> base pointer
        self._used: dict[tuple[int, bytes], float] = {}  # when each was last used
        self._lock = threading.Lock()
        self.opened = 0  # how many times an allocation had to be opened (the rest were found open)
        # the time those opens took (the first also enables peer access to another GPU): what a fetch pays
        # once per allocation, and what a first sweep after a launch pays more than the second
        self.open_seconds = 0.0

    def copy_into(self, ipc: CudaIpc, dst: torch.Tensor) -> None:
        """Queue the copy of the shared bytes into `dst` (contiguous, as many bytes, on a GPU of this node) on its
        device's current stream. The driver copies by address (one address space, peer access enabled at open),
        so the source may lie on another GPU — no tensor over foreign memory, whose device torch would guess."""
        if not (dst.is_cuda and dst.is_contiguous()) or dst.numel() * dst.element_size() != ipc.size_bytes:
            raise ValueError(f"the copy needs a contiguous GPU tensor of {ipc.size_bytes} bytes")
        source = self.pointer(ipc, dst.device)
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        _Driver.check(_Driver.lib().cuMemcpyDtoDAsync_v2(dst.data_ptr(), source, ipc.size_bytes, stream),
                      "cuMemcpyDtoDAsync")

    def copy_into_slot(self, ipc: CudaIpc, shape: list[int], whole: torch.Tensor, slot: int) -> None:
        """Queue the copy of a shared KV of `shape` [layers, 2, kv_heads, tokens, head_dim] (contiguous, the cache's
        dtype) straight into `slot` of a KV cache `whole` [layers, 2, slots, kv_heads, max_len, head_dim] on the
        current stream: one driver call for every layer and head, no buffer between (kv.copy_shared_into)."""
        layers, pair, heads, tokens, head_dim = shape
        slots, max_len = whole.shape[2], whole.shape[4]
        size = whole.element_size()
        if not (whole.is_cuda and whole.is_contiguous()) or [layers, pair, heads, head_dim] != [
                whole.shape[0], whole.shape[1], whole.shape[3], whole.shape[5]] or not 0 < tokens <= max_len \
                or not 0 <= slot < slots or layers * pair * heads * tokens * head_dim * size != ipc.size_bytes:
            raise ValueError(f"a KV of shape {shape} ({ipc.size_bytes} bytes) does not fit slot {slot} of a cache "
                             f"of shape {list(whole.shape)} ({whole.dtype})")
        source = self.pointer(ipc, whole.device)
        row = max_len * head_dim * size  # one head's tokens in the cache
        copy = _Memcpy3D(srcMemoryType=_MEMORYTYPE_DEVICE, srcDevice=source, srcPitch=tokens * head_dim * size,
                         srcHeight=heads, dstMemoryType=_MEMORYTYPE_DEVICE,
                         dstDevice=whole.data_ptr() + slot * heads * row, dstPitch=row, dstHeight=slots * heads,
                         WidthInBytes=tokens * head_dim * size, Height=heads, Depth=layers * pair)
        stream = torch.cuda.current_stream(whole.device).cuda_stream
        _Driver.check(_Driver.lib().cuMemcpy3DAsync_v2(ctypes.byref(copy), stream), "cuMemcpy3DAsync")

    def pointer(self, ipc: CudaIpc, device: torch.device) -> int:
        """Where the shared bytes are in this process, opening their allocation unless it is open already."""
        if ipc.offset_bytes < 0 or ipc.size_bytes < 0 or ipc.offset_bytes + ipc.size_bytes > ipc.allocation_bytes:
            raise ValueError(f"shared bytes [{ipc.offset_bytes}, +{ipc.size_bytes}) lie outside their allocation "
                             f"of {ipc.allocation_bytes}")
        key = (device.index or 0, ipc.handle)
        with self._lock:
            lib = _Driver.use(device)
            base = self._open.get(key)
            if base is None:
                pointer = ctypes.c_uint64()
                began = time.perf_counter()
                _Driver.check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(pointer), _Handle.of(ipc.handle),
                                                        _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
                self.open_seconds += time.perf_counter() - began
                base = self._open[key] = pointer.value
                self.opened += 1
            self._open.move_to_end(key)
            now = time.monotonic()
            self._used[key] = now
            while len(self._open) > self.limit or now - self._used[next(iter(self._open))] > IDLE_CLOSE_S:
                self._close_oldest()
            _Driver.use(device)
        return base + ipc.offset_bytes

    def _close_oldest(self) -> None:
        (device, handle), base = self._open.popitem(last=False)
        self._used.pop((device, handle), None)
        _Driver.check(_Driver.use(torch.device("cuda", device)).cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")

    @property
    def open_count(self) -> int:
        return len(self._open)

    def close(self) -> None:
        with self._lock:
            while self._open:
                try:
                    self._close_oldest()
                except RuntimeError:  # the context went first (process exit): the driver frees the mappings
                    self._open.clear()
