"""A sparse mixture-of-experts feed-forward (Mixtral's layout and names) with expert parallelism.

Without expert parallelism every rank holds every expert (column/row-sharded over the TP ranks like the dense
MLP, then one all-reduce). With expert parallelism (EP == TP, as TensorRT-LLM's `moe_expert_parallel_size`
with MoE-TP 1) each rank holds a contiguous share of the experts whole, and tokens travel to their experts:
each rank routes its own slice of the batch's tokens, sends every (token, expert) pair to the expert's rank by
all-to-all, runs its experts on what arrived, sends the results back by all-to-all, weighs them, and the
slices are gathered so every rank again holds the whole batch (attention stays tensor-parallel and needs it).
The single-rank path does the same arithmetic in the same order, so fp32 greedy tokens agree across layouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ExpertParallel:
    """This rank's share of the experts; `group` None means one rank holds them all."""

    def __init__(self, rank: int = 0, size: int = 1, group=None) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.sent_pairs = 0  # (token, expert) pairs this rank sent to another rank: proof the exchange ran

    def experts(self, count: int) -> range:
        if count % self.size:
            raise ValueError(f"{count} experts do not split over expert-parallel size {self.size}")
        per = count // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def all_to_all(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=self.group)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv.tolist()

    def gather_slices(self, part: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """Every rank's token slice, in rank order (slices may differ by one row, so pad to the longest)."""
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        padded = part.new_zeros((longest, *part.shape[1:]))
        padded[:part.shape[0]] = part
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:b - a] for p, a, b in zip(parts, bounds, bounds[1:])])


class Expert(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)  # gate
        self.w3 = nn.Linear(hidden, inner, bias=False)  # up
        self.w2 = nn.Linear(inner, hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg, tp, ep: ExpertParallel) -> None:
        super().__init__()
        if ep.size > 1 and tp.size != ep.size:
            raise ValueError(f"expert parallelism {ep.size} with tensor parallelism {tp.size}: the torch engine "
                             f"runs EP equal to TP (MoE-TP 1) or EP 1")
        shard = tp.size if ep.size == 1 else 1
        if cfg.intermediate_size % shard:
            raise ValueError(f"intermediate size {cfg.intermediate_size} does not split over TP {shard}")
        self.tp, self.ep, self.top_k = tp, ep, cfg.num_experts_per_tok
        self.num_experts = cfg.num_local_experts
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        # keyed by the global expert index, so a rank's state dict keeps the checkpoint's names
        self.experts = nn.ModuleDict({str(e): Expert(cfg.hidden_size, cfg.intermediate_size // shard)
                                      for e in ep.experts(cfg.num_local_experts)})

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixtral's router: softmax over all experts, the top k, renormalised. -> (weights, experts) [N, k]."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), experts

    def run_experts(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        for key, expert in self.experts.items():
            picked = (experts == int(key)).nonzero(as_tuple=True)[0]
            if picked.numel():
                out[picked] = expert(rows[picked])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.ep.size == 1:
            out = self._combine(flat, lambda rows, experts: self.run_experts(rows, experts))
            return self.tp.all_reduce(out).reshape(shape)
        n, ep = flat.shape[0], self.ep
        bounds = [n * i // ep.size for i in range(ep.size + 1)]
        mine = flat[bounds[ep.rank]:bounds[ep.rank + 1]]
        out = self._combine(mine, self._dispatch)
        return ep.gather_slices(out, bounds).reshape(shape)

    def _combine(self, tokens: torch.Tensor, compute) -> torch.Tensor:
        """Each token's k expert outputs, weighed and summed in k order (the same order on every layout)."""
        weights, experts = self.route(tokens)
        pairs = compute(tokens.repeat_interleave(self.top_k, dim=0), experts.reshape(-1))
        return (weights.unsqueeze(-1) * pairs.view(tokens.shape[0], self.top_k, tokens.shape[-1])).sum(1)

    def _dispatch(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """(token, expert) pairs to their experts' ranks and the results back, by two all-to-alls each way."""
        ep = self.ep
        owner = experts // (self.num_experts // ep.size)
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=ep.size)
        send = send_counts.tolist()
        recv = ep.exchange_counts(send_counts)
        ep.sent_pairs += sum(send) - send[ep.rank]
        arrived = ep.all_to_all(rows[order], send, recv)
        arrived_experts = ep.all_to_all(experts[order], send, recv)
        results = ep.all_to_all(self.run_experts(arrived, arrived_experts), recv, send)
        out = torch.empty_like(results)
        out[order] = results
        return out


def expert_state_dict(state: dict[str, torch.Tensor], ep: ExpertParallel,
                      num_experts: int) -> dict[str, torch.Tensor]:
    """A full checkpoint less the experts other ranks hold (gates, attention and the rest stay)."""
    if ep.size == 1:
        return state
    own = ep.experts(num_experts)
    marker = ".block_sparse_moe.experts."
    return {name: tensor for name, tensor in state.items()
            if marker not in name or int(name.split(marker, 1)[1].split(".", 1)[0]) in own}
