"""KV handoff through NIXL (UCX underneath), the transfer library TensorRT-LLM's cache transceiver and Dynamo use:
the prefill worker registers the KV tensor where it lies (host memory or a GPU), the decode worker READs it straight
into its own tensor — GPU to GPU across nodes over RDMA/TCP, or through CUDA IPC/shared memory on one node, as UCX
finds. No host copy on either side, no bytes through the RPC connection.

Agent metadata travels inside the RPC answer: each lend sends the partial metadata of its one registration, plus
how to reach this process's UCX worker the first time a reader asks: no NIXL listener thread, no extra port.
nixl is imported lazily (the `nixl` extra), so nothing here costs a launcher.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from hpc.runtime.engine.kv.pack import handoff_buffer
from hpc.runtime.serve.wire import KvMeta, NixlKv

# How long a lent KV stays registered without its reader's ReleaseKv (the engine's own handoff TTL).
LEND_TTL_S = 120.0
READ_TIMEOUT_S = 60.0


class NixlUnavailable(RuntimeError):
    pass


def nixl_api() -> Any:
    """nixl's Python API module: the CUDA-13 build's own module, else the `nixl` meta package's alias of it."""
    try:
        return importlib.import_module("nixl_cu13._api")
    except ImportError:
        try:
            from nixl import _api  # pyright: ignore[reportAttributeAccessIssue]  # the meta package's alias

            return _api
        except ImportError:
            raise NixlUnavailable("NIXL is not installed here: pip install 'hpc[nixl]' (nixl-cu13) on every node, "
                                  "or set runtime.kv_transport to bytes") from None


def nixl_available() -> bool:
    try:
        nixl_api()
    except (NixlUnavailable, OSError):  # OSError: the wheel is there but a shared library it needs is not
        return False
    return True


def _infiniband_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


@dataclass
class _Lent:
    registration: Any
    tensor: torch.Tensor  # held so the registered memory stays allocated until the reader is done
    at: float


class NixlTransport:
    """One NIXL agent per worker process. Thread-safe: reads run in worker threads, lends on the event loop."""

    def __init__(self, name: str) -> None:
        # UCX turns CUDA IPC reads off where it sees no NVLink (PCIe boxes, one-GPU VMs) and then emulates them
        # through TCP: 0.5 GB/s instead of ~160 GB/s for a 262 MB KV on one H100 (docs/performance.md). Our
        # decode side reads, so keep them on unless the user chose otherwise.
        # (Not where UCX_TLS is set: that user chose the transports, and UCX warns about variables of unused ones.)
        if torch.cuda.is_available() and "UCX_TLS" not in os.environ:
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        # Without InfiniBand devices, keep UCX's ib module unloaded: the libnl it pulls in (bundled in the wheel)
        # crashes the process at exit (SIGSEGV in rtnl_tc_unregister, every exit after an agent started here).
        if "UCX_MODULES" not in os.environ and not _infiniband_devices():
            os.environ["UCX_MODULES"] = "^ib"
        api = nixl_api()
        config = api.nixl_agent_config(backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"  # a restarted worker is a new agent to its readers
        self.agent = api.nixl_agent(self.name, config)
        self._lent: dict[str, _Lent] = {}
        self._peers: dict[str, str] = {}  # RPC address -> the agent name added from its metadata
        self._lock = threading.Lock()

    # ---- the prefill side -------------------------------------------------------------------------------------------
    def lend(self, handle: str, kv: torch.Tensor, reader_knows: str = "") -> KvMeta:
        """Register `kv` for reading until withdraw(handle); the answer tells the reader where it lies: this
        region's metadata, with the connection info unless the reader already added this agent (`reader_knows`)."""
        kv = kv.contiguous()
        self._expire()
        self.withdraw(handle)  # asked again (a retried fetch): one registration per handle
        registration = self.agent.register_memory(kv)
        with self._lock:
            self._lent[handle] = _Lent(registration, kv, time.monotonic())
        descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(kv))
        metadata = self.agent.get_partial_agent_metadata(registration, inc_conn_info=reader_knows != self.name)
        return KvMeta(shape=list(kv.shape), dtype=str(kv.dtype),
                      nixl=NixlKv(agent=self.name, metadata=metadata, descs=descs))

    def withdraw(self, handle: str) -> bool:
        with self._lock:
            lent = self._lent.pop(handle, None)
        if lent is not None:
            self.agent.deregister_memory(lent.registration)
        return lent is not None

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [h for h, lent in self._lent.items() if now - lent.at > LEND_TTL_S]
        for handle in stale:
            self.withdraw(handle)

    @property
    def lent(self) -> int:
        return len(self._lent)

    # ---- the decode side --------------------------------------------------------------------------------------------
    def known_agent(self, address: str) -> str:
        return self._peers.get(address, "")

    def read(self, address: str, meta: KvMeta, device: str | torch.device, dtype: torch.dtype) -> torch.Tensor:
        """READ the KV described by `meta` (lent by the agent at RPC `address`) into a new tensor on `device`;
        complete on return, so the lender may withdraw it."""
        where = meta.nixl
        if where is None:
            raise ValueError("this KV description carries no NIXL location")
        added = self.agent.add_remote_agent(where.metadata)  # the lent region (and how to connect, the first time)
        added = added.decode() if isinstance(added, bytes) else added
        with self._lock:
            self._peers[address] = added
        kv = handoff_buffer(meta.shape, dtype, device)
        registration = self.agent.register_memory(kv)
        try:
            remote = self.agent.deserialize_descs(where.descs)
            xfer = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(kv), remote, where.agent)
            try:
                state = self.agent.transfer(xfer)
                deadline = time.monotonic() + READ_TIMEOUT_S
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"NIXL read from {where.agent} took over {READ_TIMEOUT_S:.0f} s")
                    time.sleep(0)  # let the event loop's thread run between polls
                    state = self.agent.check_xfer_state(xfer)
                if state != "DONE":
                    raise RuntimeError(f"NIXL read from {where.agent} failed ({state})")
            finally:
                self.agent.release_xfer_handle(xfer)
        finally:
            self.agent.deregister_memory(registration)
        return kv

    def close(self) -> None:
        for handle in list(self._lent):
            self.withdraw(handle)
