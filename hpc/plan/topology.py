"""MPI rank -> (pp, tp, ep, dp) coordinates and local GPU; shared by the plan and the runtime.

TensorRT-LLM's Mapping convention: rank = pp_rank * tp + tp_rank; experts split the tensor-parallel
group (moe_ep_rank = tp_rank % ep); with attention-DP every tensor-parallel rank is its own
attention data-parallel rank. srun's default block distribution puts consecutive ranks on a node.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoords:
    rank: int
    node_offset: int  # which of the worker's nodes (0-based)
    local_rank: int
    gpu: int  # GPU index on that node
    pp: int
    tp: int
    ep: int
    dp: int


def rank_coords(rank: int, *, tp: int, pp: int, ep: int, attention_dp: bool, tasks_per_node: int,
                gpu_offset: int = 0) -> RankCoords:
    if not 0 <= rank < tp * pp:
        raise ValueError(f"rank {rank} outside world of size {tp * pp}")
    tp_rank = rank % tp
    return RankCoords(
        rank=rank,
        node_offset=rank // tasks_per_node,
        local_rank=rank % tasks_per_node,
        gpu=gpu_offset + rank % tasks_per_node,
        pp=rank // tp,
        tp=tp_rank,
        ep=tp_rank % ep,
        dp=tp_rank if attention_dp else 0,
    )
