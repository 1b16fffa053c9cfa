"""What a profile is asked for, checked before anything starts (one line each, exit 2)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hpc.errors import UserError
from hpc.resolve import Resolved
from hpc.spec.cluster import ClusterProfile


class ProfileRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    isl: int  # input tokens of the target workload
    osl: int  # output tokens
    ttft_ms: float  # SLA: time to first token
    itl_ms: float  # SLA: inter-token latency
    tps: list[int] = Field(default_factory=lambda: [1])  # tensor-parallel sizes to profile
    max_gpus: int | None = None
    requests: int = 8  # per point (at least 4 x concurrency for decode levels)
    max_concurrency: int = 64


def check_request(req: ProfileRequest, resolved: Resolved) -> None:
    """Bad SLA inputs and layouts the cluster cannot hold: one clear line naming the flag."""
    recipe, cluster = resolved.recipe, resolved.cluster
    if recipe.modality == "video_diffusion":
        raise UserError("hpc profile sizes text serving (TTFT, ITL); a video recipe is measured with hpc bench",
                        file=resolved.recipe_file, field="modality", hint="hpc launch it, then hpc bench RUN")
    pooled = [name.value for name, spec in recipe.roles.items() if spec.pools]
    if pooled:
        raise UserError("a profile sizes one layout and writes the pools itself",
                        file=resolved.recipe_file, field=f"roles.{pooled[0]}.pools",
                        hint="profile the recipe without pools, or one pool: hpc recipe convert --pool NAME")
    for flag, value in (("--isl", req.isl), ("--osl", req.osl), ("--ttft", req.ttft_ms), ("--itl", req.itl_ms),
                        ("--requests", req.requests), ("--max-concurrency", req.max_concurrency)):
        if not value > 0 or value != value or value == float("inf"):
            raise UserError(f"must be a positive number (got {value:g})", field=flag)
    if req.isl > recipe.limits.max_input_tokens:
        raise UserError(f"--isl {req.isl} is above the recipe's limits.max_input_tokens "
                        f"{recipe.limits.max_input_tokens}", file=resolved.recipe_file, field="limits.max_input_tokens",
                        hint="profile a shorter input or raise the limit")
    if req.osl > recipe.limits.max_output_tokens:
        raise UserError(f"--osl {req.osl} is above the recipe's limits.max_output_tokens "
                        f"{recipe.limits.max_output_tokens}", file=resolved.recipe_file,
                        field="limits.max_output_tokens", hint="profile a shorter output or raise the limit")
    for group, args in resolved.engine_args.items():
        seq = args.get("max_seq_len")
        if isinstance(seq, int) and req.isl + req.osl > seq:
            raise UserError(f"--isl {req.isl} + --osl {req.osl} = {req.isl + req.osl} exceeds {group}'s max_seq_len "
                            f"{seq}", file=resolved.engine_config_files.get(group) or resolved.recipe_file,
                            field="max_seq_len", hint="profile shorter sequences or raise max_seq_len")
    if not req.tps or any(t < 1 for t in req.tps) or len(set(req.tps)) != len(req.tps):
        raise UserError(f"{','.join(map(str, req.tps))}: give distinct sizes of at least 1", field="--tp",
                        hint="e.g. --tp 1,2,4,8")
    gpn = cluster.gpus_per_node
    for t in req.tps:
        if gpn and t % gpn and gpn % t:
            raise UserError(f"size {t} does not divide the {gpn} GPUs of a node of '{cluster.name}' (nor is it a "
                            f"multiple of them)", file=resolved.cluster_file, field="--tp",
                            hint=f"use sizes that divide {gpn} or are multiples of it")
    needed = gpus_needed(req.tps, recipe.disaggregated)
    capacity = req.max_gpus if req.max_gpus is not None else cluster_gpus(cluster)
    if req.max_gpus is not None and req.max_gpus < 1:
        raise UserError(f"must be at least 1 (got {req.max_gpus})", field="--max-gpus")
    if needed > capacity:
        per = "a prefill and a decode engine" if recipe.disaggregated else "one engine"
        raise UserError(f"the profile keeps {per} of each TP size warm: {needed} GPUs for --tp "
                        f"{','.join(map(str, req.tps))}, above the {capacity} allowed", field="--tp",
                        hint="profile fewer TP sizes, or raise --max-gpus where the cluster has them")


def gpus_needed(tps: list[int], disaggregated: bool) -> int:
    return sum(tps) * (2 if disaggregated else 1)


def cluster_gpus(cluster: ClusterProfile) -> int:
    return cluster.nodes_available * max(cluster.gpus_per_node, 1)
