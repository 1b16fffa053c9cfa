"""Tensor parallelism for the torch engine: process group from the MPI/Slurm ranks, step broadcast."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hpc.runtime.engine.models.llama import KvCache, TensorParallel
from hpc.runtime.engine.torch.sampling import on_device

if TYPE_CHECKING:
    from hpc.runtime.engine.torch.core import EngineCore

_STOP, _PREFILL, _DECODE, _EXPORT_KV, _IMPORT_KV = 0, 1, 2, 3, 4
_KINDS = {"prefill": _PREFILL, "decode": _DECODE}


def world_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from whichever launcher started us: Open MPI, PMIx, MPICH, Slurm, or hpc."""
    for rank_var, size_var, local_var in (
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
            ("PMIX_RANK", "SLURM_NTASKS", "SLURM_LOCALID"),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
            ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
            ("HPC_RANK", "HPC_WORLD_SIZE", "HPC_LOCAL_RANK")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var]), int(os.environ.get(local_var, 0))
    return 0, 1, 0


def init_group(rank: int, world: int, master: str, device: torch.device) -> TensorParallel:
    """The TP process group: NCCL bound to this rank's GPU, or gloo on CPU."""
    if device.type == "cuda":
        dist.init_process_group("nccl", init_method=f"tcp://{master}", rank=rank, world_size=world,
                                device_id=device)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world)
    return TensorParallel(rank=rank, size=world, group=dist.group.WORLD)


def broadcast_step(tp: TensorParallel, kind: str, embeds: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor) -> None:
    b, t, h = embeds.shape
    header = torch.tensor([_KINDS[kind], b, t, h], dtype=torch.long, device=embeds.device)
    dist.broadcast(header, 0, group=tp.group)
    dist.broadcast(embeds.contiguous(), 0, group=tp.group)
    dist.broadcast(positions.contiguous(), 0, group=tp.group)
    dist.broadcast(slots.contiguous(), 0, group=tp.group)


def _local_kv(cache: KvCache, slot: int, length: int) -> torch.Tensor:
    """This rank's KV of one slot: [layers, 2, its kv heads, length, head_dim]."""
    return cache.whole[:, :, slot, :, :length].contiguous()


def gather_kv(tp: TensorParallel, cache: KvCache, slot: int, length: int) -> torch.Tensor:
    """Rank 0: the whole KV of a slot, every rank's heads in rank order (the checkpoint's order: each rank holds a
    contiguous run of KV heads). The other ranks take part from follow(). One rank: its own copy."""
    if tp.size == 1:
        return _local_kv(cache, slot, length)
    header = torch.tensor([_EXPORT_KV, slot, length, 0], dtype=torch.long, device=cache[0].device)
    dist.broadcast(header, 0, group=tp.group)
    local = _local_kv(cache, slot, length)
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local, group=tp.group)
    return torch.cat(parts, dim=2)


def gather_kvs(tp: TensorParallel, cache: KvCache, slots: list[int], length: int) -> list[torch.Tensor]:
    """gather_kv of slots that hold `length` tokens alike. One rank takes them all in one gather, each its own
    contiguous part of one buffer, instead of an allocation and a copy kernel apiece (20-30 µs of the scheduler's
    time each, and a prefill step's prompts are mostly of one length); the buffer lives until the last of them is
    released."""
    if tp.size > 1 or len(slots) == 1:
        return [gather_kv(tp, cache, slot, length) for slot in slots]
    per_slot = cache.whole[:, :, :, :, :length].movedim(2, 0)  # [slots, layers, 2, kv heads, T, d]
    return list(per_slot[on_device(slots, cache.whole.device)].unbind(0))


def scatter_kv(tp: TensorParallel, cache: KvCache, slot: int, kv: torch.Tensor) -> None:
    """Rank 0: write a whole KV [layers, 2, all kv heads, length, head_dim] into a slot of every rank, each
    keeping its own heads — whatever TP the prefill worker that made it ran."""
    if tp.size == 1:
        _write_own_heads(tp, cache, slot, kv)
        return
    heads, length = kv.shape[2], kv.shape[3]
    header = torch.tensor([_IMPORT_KV, slot, length, heads], dtype=torch.long, device=cache[0].device)
    dist.broadcast(header, 0, group=tp.group)
    kv = kv.contiguous()
    dist.broadcast(kv, 0, group=tp.group)
    _write_own_heads(tp, cache, slot, kv)


def _write_own_heads(tp: TensorParallel, cache: KvCache, slot: int, kv: torch.Tensor) -> None:
    own = cache[0].shape[2]  # kv heads per rank
    cache.whole[:, :, slot, :, :kv.shape[3]] = kv[:, :, tp.rank * own:(tp.rank + 1) * own]


def broadcast_stop(tp: TensorParallel, device: torch.device) -> None:
    dist.broadcast(torch.tensor([_STOP, 0, 0, 0], dtype=torch.long, device=device), 0, group=tp.group)


def follow(core: "EngineCore") -> None:
    """Ranks > 0: run every forward pass rank 0 broadcasts, until it says stop (on the rank's own GPU as the
    thread's current device, as the engine's scheduler runs)."""
    with core.on_device():
        _follow(core)


def _follow(core: "EngineCore") -> None:
    device, tp = core.device, core.world
    while True:
        header = torch.empty(4, dtype=torch.long, device=device)
        dist.broadcast(header, 0, group=tp.group)
        kind, b, t, h = header.tolist()
        if kind == _STOP:
            return
        if kind == _EXPORT_KV:  # (slot, length): hand rank 0 this rank's heads
            local = _local_kv(core.cache, b, t)
            dist.all_gather([torch.empty_like(local) for _ in range(tp.size)], local, group=tp.group)
            continue
        if kind == _IMPORT_KV:  # (slot, length, all heads): take this rank's heads of rank 0's whole KV
            cache = core.cache
            kv = torch.empty(len(cache), 2, h, t, cache[0].shape[-1], dtype=cache[0].dtype, device=device)
            dist.broadcast(kv, 0, group=tp.group)
            _write_own_heads(tp, cache, b, kv)
            continue
        embeds = torch.empty(b, t, h, dtype=core.dtype, device=device)
        positions = torch.empty(b, t, dtype=torch.long, device=device)
        slots = torch.empty(b, dtype=torch.long, device=device)
        for tensor in (embeds, positions, slots):
            dist.broadcast(tensor, 0, group=tp.group)
        core.model.forward_step(embeds, positions, slots, core.cache)
