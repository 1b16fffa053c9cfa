"""The decode step's tensor-parallel all-reduce over peer memory, with the residual add in the same kernel.

At batch 1 a TP=2 step of the 8B shape ran 64 NCCL all-reduces of 16 KB (5.5 µs each) and 64 residual-add
launches, and every NCCL kernel broke the chain of programmatic dependent launches: the GEMV after it could not
start fetching its weights until the all-reduce had ended. Here each rank's row-parallel GEMV writes its fp32
partial sums into a buffer every rank of the node can write to (torch symmetric memory: NVLink peer mappings),
and one small Triton kernel per all-reduce

1. lets the next kernel launch at once (its weights stream in while this one waits),
2. pushes this rank's partial sums into every peer's buffer (stores travel one way; nothing waits for a remote
   read), then, per program, sets a word in each peer's signal pad and waits for each peer's word in its own
   (words go 0 → 1 → 0, so the pads are zero between calls and nothing is counted on the host: a CUDA graph
   replays the kernel as it is),
3. adds every rank's partial sums in rank order (the same bits on every rank), all now in local memory, and the
   residual in fp32, and writes the new hidden state once rounded: what `all_reduce` + `add_residual` gave.

Each buffer holds two slots (the attention's all-reduce writes slot 0, the MLP's slot 1) of one area per sending
rank, and each slot has its own words. A rank writes into a slot of a peer, or sets its word there, only two
all-reduces after the last time; in between it passed the other slot's barrier, which the peer reaches only once
its previous kernel (its reads of this slot, its taking of the word) has finished.

Used where every rank of the group is on one node and sees the others' GPUs; otherwise (and with
HPC_PEER_REDUCE=0) the decoder keeps NCCL's all-reduce. Like NCCL's, a rank whose peer never arrives waits.
"""

from __future__ import annotations

import logging
import os
import socket
import zlib

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda  # programmatic dependent launch (gdc_wait, ...)

from hpc.runtime.engine.kernels.launch import launch

SLOTS = 2  # attention's all-reduce, then the MLP's
BLOCK = 512  # elements per program (and per signal word): 8 pushes and waits at once for a row of 4,096, not 4
MAX_PROGRAMS = 64  # signal words per slot and sender: room for 32 K elements (8 rows of 4,096)
log = logging.getLogger(__name__)


@triton.jit
def _peer_reduce_kernel(buffers_ptr, pads_ptr, residual_ptr, out_ptr, slot, numel, capacity, RANK: tl.constexpr,
                        WORLD: tl.constexpr, BLOCK: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    if USE_PDL:
        tl_cuda.gdc_launch_dependents()  # the next GEMV may start fetching its weights
        tl_cuda.gdc_wait()  # our partial sums, the previous kernel's output, are written
    at = pid * BLOCK + tl.arange(0, BLOCK)
    mask = at < numel
    area = slot * WORLD * capacity  # this slot's areas, one per sending rank
    own = tl.load(buffers_ptr + RANK).to(tl.pointer_type(tl.float32))
    mine = tl.load(own + area + RANK * capacity + at, mask=mask, other=0.0)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            theirs = tl.load(buffers_ptr + peer).to(tl.pointer_type(tl.float32))
            tl.store(theirs + area + RANK * capacity + at, mine, mask=mask)
    tl.debug_barrier()  # every thread's stores are issued before the word that says they are there
    word = (slot * MAX_PROGRAMS + pid) * WORLD
    for peer in tl.static_range(WORLD):
        if peer != RANK:  # release: our stores reach the peer before the word does
            pad = tl.load(pads_ptr + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(pad + word + RANK, 1, sem="release", scope="sys")
    own_pad = tl.load(pads_ptr + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:  # wait for the peer's word, and clear it for its next call
            while tl.atomic_cas(own_pad + word + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(WORLD):  # rank order on every rank: the same sum everywhere
        if rank == RANK:
            total += mine
        else:  # volatile: never a line cached before the peer wrote it
            total += tl.load(own + area + rank * capacity + at, mask=mask, other=0.0, volatile=True)
    total += tl.load(residual_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)


class PeerReduce:
    """Slots of fp32 partial sums [rows, width] per rank in symmetric memory, and the kernel that reduces them."""

    def __init__(self, buffer: torch.Tensor, buffer_ptrs: list[int], pad_ptrs: list[int], rank: int,
                 rows: int, width: int, use_pdl: bool) -> None:
        self.buffer, self.rank, self.world = buffer, rank, len(buffer_ptrs)
        self.rows, self.width, self.use_pdl = rows, width, use_pdl
        self.capacity = rows * width
        self.buffers = torch.tensor(buffer_ptrs, dtype=torch.int64, device=buffer.device)
        self.pads = torch.tensor(pad_ptrs, dtype=torch.int64, device=buffer.device)

    @classmethod
    def connect(cls, group, device: torch.device, rows: int, width: int) -> "PeerReduce | None":
        """Collective over `group` (CUDA ranks): a PeerReduce on every rank, or None on every rank where peer
        memory is not for this group (ranks on several nodes, GPUs without peer access, HPC_PEER_REDUCE=0)."""
        from hpc.runtime.engine.kernels.decode_kernels import _use_pdl

        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError:  # a torch without it: every rank alike
            symm_mem = None
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        wanted = symm_mem is not None and os.environ.get("HPC_PEER_REDUCE", "1") == "1" \
            and triton.cdiv(rows * width, BLOCK) <= MAX_PROGRAMS
        reachable = _peers_reachable(group, device, world)  # collective: asked on every rank, wanted or not
        if not _agreed(group, device, wanted and reachable):
            log.info("TP all-reduce of the decode step: NCCL (%s)", "peer memory not wanted" if not wanted else
                     "not every rank on this host with peer access to the others' GPUs")
            return None
        try:
            buffer = symm_mem.empty(SLOTS * world * rows * width, dtype=torch.float32, device=device)
            handle = symm_mem.rendezvous(buffer, group)
            # each rank's buffer as this process sees it (its own: the tensor itself, at the allocation's start)
            ptrs = [handle.get_buffer(r, (buffer.numel(),), torch.float32).data_ptr() for r in range(world)]
            made = ptrs[rank] == buffer.data_ptr() and SLOTS * MAX_PROGRAMS * world * 4 <= handle.signal_pad_size
        except Exception as exc:  # noqa: BLE001 - a build or driver without symmetric memory: NCCL stays
            log.warning("no all-reduce over peer memory (%s); NCCL's is used", exc)
            made = False
        if not _agreed(group, device, made):
            return None
        log.info("TP all-reduce of the decode step: peer memory, %d ranks on this host", world)
        return cls(buffer, ptrs, list(handle.signal_pad_ptrs), rank, rows, width, _use_pdl(device))

    def slot(self, index: int, rows: int, sender: int | None = None) -> torch.Tensor:
        """Where this rank's GEMV writes its partial sums for the all-reduce of slot `index` (or where those of
        rank `sender` arrive)."""
        start = (index * self.world + (self.rank if sender is None else sender)) * self.capacity
        return self.buffer[start:start + rows * self.width].view(rows, self.width)

    def reduce_add(self, index: int, residual: torch.Tensor) -> torch.Tensor:
        """residual + Σ over ranks of slot `index` (fp32, rounded once), on every rank alike."""
        rows = residual.shape[0]
        assert residual.is_contiguous() and residual.shape[1] == self.width and rows <= self.rows
        out = torch.empty_like(residual)
        numel = rows * self.width
        launch(_peer_reduce_kernel, (triton.cdiv(numel, BLOCK),))(
            self.buffers, self.pads, residual, out, index, numel, self.capacity, RANK=self.rank, WORLD=self.world,
            BLOCK=BLOCK, MAX_PROGRAMS=MAX_PROGRAMS, USE_PDL=self.use_pdl, num_warps=4, launch_pdl=self.use_pdl)
        return out


def _peers_reachable(group, device: torch.device, world: int) -> bool:
    """Every rank of the group on this host, on a GPU this one can reach (collective; tensors on `device`, as
    NCCL wants them: an object collective would stage on whatever device is current)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    mine = torch.tensor([zlib.crc32(socket.gethostname().encode()), index], dtype=torch.int64, device=device)
    seen = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(seen, mine, group=group)
    hosts, indices = {int(t[0]) for t in seen}, [int(t[1]) for t in seen]
    return len(hosts) == 1 and all(other == index or torch.cuda.can_device_access_peer(index, other)
                                   for other in indices)


def _agreed(group, device: torch.device, ok: bool) -> bool:
    """True on every rank when it is true on every rank (collective)."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
