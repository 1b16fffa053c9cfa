"""Tensor parallelism: ranks from each launcher, and each rank's Megatron slice of a checkpoint (two gloo ranks)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from hpc.runtime.engine.models.llama import TensorParallel, shard_state_dict

pytestmark = pytest.mark.unit

NAMES = {"model.layers.0.self_attn.q_proj.weight": (6, 4), "model.layers.0.mlp.gate_proj.weight": (8, 4),
         "model.layers.0.self_attn.o_proj.weight": (4, 6), "model.layers.0.mlp.down_proj.weight": (4, 8),
         "model.norm.weight": (4,), "lm_head.weight": (5, 4), "model.embed_tokens.weight": (5, 4)}


def _checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in NAMES.items()}


def _rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        full = _checkpoint()
        local = shard_state_dict(full, TensorParallel(rank, 2, dist.group.WORLD))
        for name, tensor in full.items():
            layer = name.split(".")[-2]
            want = (tensor.chunk(2, 0)[rank] if layer in ("q_proj", "gate_proj")
                    else tensor.chunk(2, 1)[rank] if layer in ("o_proj", "down_proj") else tensor)
            assert type(local[name]) is torch.Tensor and torch.equal(local[name], want), name
    finally:
        dist.destroy_process_group()


def test_each_rank_keeps_its_rows_or_columns() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port,), nprocs=2)  # raises if a rank's assertion failed


def test_one_rank_keeps_the_checkpoint_as_is() -> None:
    full = _checkpoint()
    assert shard_state_dict(full, TensorParallel()) is full


@pytest.mark.parametrize("env, want", [
    ({}, (0, 1, 0)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (3, 4, 1)),
    ({"PMIX_RANK": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "5"}, (5, 8, 5)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, (1, 2, 1)),  # MPICH's mpiexec
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, (2, 4, 0)),
    ({"HPC_RANK": "1", "HPC_WORLD_SIZE": "2", "HPC_LOCAL_RANK": "1"}, (1, 2, 1)),
], ids=["none", "open-mpi", "pmix", "mpich", "slurm", "hpc-local"])
def test_world_rank_from_each_launcher(env: dict[str, str], want: tuple[int, int, int],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc.runtime.engine.torch.tp import world_rank

    for name in list(os.environ):
        if name.startswith(("OMPI_", "PMIX_", "PMI_", "MPI_", "SLURM_", "HPC_RANK", "HPC_WORLD", "HPC_LOCAL")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert world_rank() == want
