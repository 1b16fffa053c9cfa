"""The all-reduce over peer memory (`peer_reduce`): on CPU through Triton's interpreter, two ranks' kernels in one
of the orders the barrier allows; on two GPUs, against NCCL's all-reduce + the residual add, bit for bit."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the CI installs it for these tests)")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("without a GPU these kernels run only under TRITON_INTERPRET=1 (set in tests/conftest.py)",
                allow_module_level=True)

ROWS, WIDTH = 2, 1280  # 512-element programs: one row takes three (the third partly masked), two rows five


@pytest.mark.unit
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="host buffers: the interpreter's test")
def test_two_ranks_sum_in_rank_order_and_clear_each_others_words() -> None:
    """The interpreter runs one kernel at a time, so rank 1 goes first in part: its partial sums already pushed
    into rank 0's buffer and its word set in rank 0's pad, as if it had arrived earlier; then rank 0 runs whole
    (pushes, sets its word, takes rank 1's), then rank 1 (finds rank 0's word). Six calls alternate the two
    slots, as attention's and the MLP's all-reduces do, with one row (two programs) or two (three)."""
    from hpc.runtime.engine.kernels.peer_reduce import BLOCK, MAX_PROGRAMS, SLOTS, PeerReduce

    assert WIDTH % BLOCK, "one row's last program partly masked"
    world = 2
    buffers = [torch.zeros(SLOTS * world * ROWS * WIDTH) for _ in range(world)]
    pads = [torch.zeros(SLOTS * MAX_PROGRAMS * world, dtype=torch.int32) for _ in range(world)]
    reducers = [PeerReduce(buffers[r], [b.data_ptr() for b in buffers], [p.data_ptr() for p in pads], r, ROWS,
                           WIDTH, use_pdl=False) for r in range(world)]
    gen = torch.Generator().manual_seed(5)
    for call in range(6):
        slot, rows = call % 2, (1, ROWS)[call % 3 == 2]
        residual = torch.randn(rows, WIDTH, generator=gen)  # fp32: the interpreter rounds to bf16 its own way
        partials = [torch.randn(rows, WIDTH, generator=gen) for _ in range(world)]
        for reducer, partial in zip(reducers, partials):
            reducer.slot(slot, rows).copy_(partial)
        other = [b.clone() for b in buffers]
        want = (partials[0] + partials[1]) + residual
        programs = -(-rows * WIDTH // BLOCK)
        words = [(slot * MAX_PROGRAMS + p) * world for p in range(programs)]
        reducers[0].slot(slot, rows, sender=1).copy_(partials[1])  # rank 1's push, and its words
        pads[0][[w + 1 for w in words]] = 1
        for rank in range(world):
            got = reducers[rank].reduce_add(slot, residual)
            assert torch.equal(got, want), (call, rank)
        # each rank holds both partial sums in this slot's areas, the other slot's areas untouched
        for reducer, buffer, before in zip(reducers, buffers, other):
            assert all(torch.equal(reducer.slot(slot, rows, sender=r), partials[r]) for r in range(world))
            assert torch.equal(buffer.view(SLOTS, world, -1)[1 - slot], before.view(SLOTS, world, -1)[1 - slot])
        # rank 1 took rank 0's words; its own for rank 0 are left, in this slot and program's places only
        assert pads[1].sum() == 0
        assert pads[0].nonzero().flatten().tolist() == [w + 1 for w in words]
        pads[0].zero_()  # (in a real run rank 0 takes those in this call)


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from hpc.runtime.engine.kernels import decode_kernels
    from hpc.runtime.engine.kernels.peer_reduce import PeerReduce

    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=device)
    with torch.cuda.device(device):  # current while the engine loads and steps (TorchEngine.on_device)
        peer = PeerReduce.connect(dist.group.WORLD, device, 4, 4096)
        result = {"connected": peer is not None, "same": [], "graph_same": None}
        if peer is not None:
            result.update(_compare(peer, device, rank, decode_kernels))
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(result, handle)
    dist.barrier()
    dist.destroy_process_group()


def _compare(peer, device: torch.device, rank: int, kernels) -> dict:
    """peer.reduce_add against NCCL's all-reduce + add_residual: eagerly for 1-4 rows in both slots, then as 64
    all-reduces in one CUDA graph (a step of 32 layers) replayed with new partial sums."""
    import torch.distributed as dist

    gen = torch.Generator(device).manual_seed(11 + rank)
    residual = torch.randn(4, 4096, device=device, generator=gen).to(torch.bfloat16)
    same = []
    for call in range(40):
        slot, rows = call % 2, 1 + call % 4
        peer.slot(slot, rows).normal_(generator=gen)
        reference = peer.slot(slot, rows).clone()
        dist.all_reduce(reference)
        want = kernels.add_residual(reference, residual[:rows].contiguous())
        same.append(bool(torch.equal(peer.reduce_add(slot, residual[:rows].contiguous()), want)))
    source = torch.empty(64, 4096, device=device)
    first = residual[:1].contiguous()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        h = first
        for call in range(64):
            peer.slot(call % 2, 1).copy_(source[call:call + 1])
            h = peer.reduce_add(call % 2, h)
    graph_same = []
    for _ in range(5):
        source.normal_(generator=gen)
        graph.replay()
        summed = source.clone()
        dist.all_reduce(summed)
        want = first
        for call in range(64):
            want = kernels.add_residual(summed[call:call + 1].contiguous(), want)
        graph_same.append(bool(torch.equal(h, want)))
    return {"same": same, "graph_same": graph_same}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_peer_all_reduce_equals_nccl_and_add_on_two_gpus(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, str(tmp_path / "rank")), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank.{r}").read_text()) for r in range(2)]
    assert [r["connected"] for r in ranks] == [True, True], "peer memory between two GPUs of one host"
    for r in ranks:
        assert r["same"] == [True] * 40
        assert r["graph_same"] == [True] * 5


def _connect_rank(rank: int, port: int, case: str, out: str) -> None:
    """One of two gloo ranks asking for peer memory with one thing amiss on rank 1 (or nothing): `connect` must
    answer alike on both ranks and never leave one waiting in a collective the other skipped."""
    import socket as sockets
    import torch.distributed as dist

    from hpc.runtime.engine.kernels import peer_reduce

    if case == "turned-off-on-one-rank" and rank == 1:
        os.environ["HPC_PEER_REDUCE"] = "0"
    host = sockets.gethostname()
    peer_reduce.socket.gethostname = lambda: host + ("-other" if case == "another-host" and rank == 1 else "")
    torch.cuda.current_device = lambda: rank  # the ranks' "GPUs": gloo carries the collectives on CPU tensors
    torch.cuda.can_device_access_peer = lambda a, b: case != "no-peer-access"
    import torch.distributed._symmetric_memory as symm_mem

    tried, empty = [], symm_mem.empty
    symm_mem.empty = lambda *a, **k: tried.append(1) or empty(*a, **k)  # raises: CPU tensors it cannot map
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        got = peer_reduce.PeerReduce.connect(dist.group.WORLD, torch.device("cpu"), 4, 4096)
        with open(f"{out}.{rank}", "w") as handle:
            json.dump({"connected": got is not None, "tried_symmetric_memory": bool(tried)}, handle)
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
@pytest.mark.parametrize("case", ["turned-off-on-one-rank", "another-host", "no-peer-access",
                                  "symmetric-memory-fails"])  # the last: CPU tensors, which it cannot map
def test_every_rank_falls_back_to_nccl_together(tmp_path, case) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_connect_rank, args=(port, case, str(tmp_path / "rank")), nprocs=2, join=True)
    # refused before any symmetric memory is made where a check says no; made, failed and refused together else
    tried = case == "symmetric-memory-fails"
    assert [json.loads((tmp_path / f"rank.{r}").read_text()) for r in range(2)] == \
        [{"connected": False, "tried_symmetric_memory": tried}] * 2
