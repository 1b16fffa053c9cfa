"""Upstream: tensorrt_llm/disaggregated_params.py.

Modelled: the kw_only dataclass with its fields, request_type validation in __post_init__ (lower-cased;
anything but context_only / generation_only / context_and_generation is a ValueError), the mm-hash checks, and
get_context_phase_params() preferring disagg_request_id over ctx_request_id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")


@dataclass(slots=True, kw_only=True)
class ContextPhaseParams:
    """Stands in for tensorrt_llm.bindings.executor.ContextPhaseParams."""

    first_gen_tokens: List[int]
    req_id: Optional[int]
    opaque_state: Optional[bytes]
    draft_tokens: Optional[List[int]]
    ctx_dp_rank: Optional[int]
    ctx_info_endpoint: Optional[str]


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    request_type: Optional[str] = None
    first_gen_tokens: Optional[List[int]] = None
    first_gen_log_probs: Optional[List] = None
    first_gen_logits: Optional[List] = None
    ctx_request_id: Optional[int] = None
    opaque_state: Optional[bytes] = None
    draft_tokens: Optional[List[int]] = None
    disagg_request_id: Optional[int] = None
    ctx_dp_rank: Optional[int] = None
    ctx_info_endpoint: Optional[str] = None
    schedule_style: Optional[int] = None
    multimodal_embedding_handles: Optional[List[Dict[str, Any]]] = None
    multimodal_hashes: Optional[List[List[int]]] = None
    mrope_position_ids_handle: Optional[Dict[str, Any]] = None
    mrope_position_deltas_handle: Optional[Dict[str, Any]] = None

    def get_context_phase_params(self) -> ContextPhaseParams:
        request_id = self.disagg_request_id if self.disagg_request_id is not None else self.ctx_request_id
        return ContextPhaseParams(first_gen_tokens=self.first_gen_tokens, req_id=request_id,
                                  opaque_state=self.opaque_state, draft_tokens=self.draft_tokens,
                                  ctx_dp_rank=self.ctx_dp_rank, ctx_info_endpoint=self.ctx_info_endpoint)

    def __post_init__(self) -> None:
        if self.request_type is not None:
            self.request_type = self.request_type.lower()
            if self.request_type not in REQUEST_TYPES:
                raise ValueError(f"Unknown request type: {self.request_type}. Must be context_only, "
                                 "generation_only or context_and_generation")
        if self.multimodal_embedding_handles is not None and self.multimodal_hashes is not None:
            assert len(self.multimodal_embedding_handles) == len(self.multimodal_hashes), \
                "multimodal_embedding_handles and multimodal_hashes must have the same length"
            for mm_hash in self.multimodal_hashes:
                assert isinstance(mm_hash, list) and len(mm_hash) == 8, "mm_hash must be a list of 8 integers"
