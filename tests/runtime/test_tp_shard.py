"""Tensor-parallel sharding of a checkpoint: two gloo ranks, each keeps its Megatron slice."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from hpc.runtime.engine.llama import TensorParallel, shard_state_dict

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
