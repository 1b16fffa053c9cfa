"""Upstream: tensorrt_llm/disaggregated_params.py.

Modelled: the kw_only slots dataclass with the fields of the version the fake runs as (tensorrt_llm/version.py;
a field that version lacks is a TypeError, as upstream's generated __init__ raises), request_type validation in
__post_init__ (lower-cased; anything but context_only / generation_only / context_and_generation is a
ValueError), the mm-hash checks, and get_context_phase_params() preferring disagg_request_id over ctx_request_id.
Which fields a version has: hpc/data/trtllm-versions.json, where a version's list is complete (1.1.0rc5 has the
first five only, from its published source); other versions get every field below.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from tensorrt_llm.version import __version__

REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")
VERSIONS = Path(__file__).resolve().parents[4] / "hpc" / "data" / "trtllm-versions.json"

FIELDS: list[tuple[str, Any]] = [
    ("request_type", Optional[str]), ("first_gen_tokens", Optional[List[int]]),
    ("first_gen_log_probs", Optional[List]), ("first_gen_logits", Optional[List]),
    ("ctx_request_id", Optional[int]), ("opaque_state", Optional[bytes]), ("draft_tokens", Optional[List[int]]),
    ("disagg_request_id", Optional[int]), ("ctx_dp_rank", Optional[int]),
    ("ctx_info_endpoint", Optional[Any]), ("schedule_style", Optional[int]),
    ("multimodal_embedding_handles", Optional[List[Dict[str, Any]]]), ("multimodal_hashes", Optional[List[List[int]]]),
    ("mrope_position_ids_handle", Optional[Dict[str, Any]]), ("mrope_position_deltas_handle", Optional[Dict[str, Any]]),
]


def version_fields() -> set[str] | None:
    """The fields of the version the fake runs as, where hpc's table lists them completely; None: all."""
    release = __version__.split("+", 1)[0]
    for entry in json.loads(VERSIONS.read_text())["versions"]:
        d = entry.get("disaggregated_params")
        if entry["version"] == release and d and d["complete"]:
            return set(d["fields"])
    return None


@dataclass(slots=True, kw_only=True)
class ContextPhaseParams:
    """Stands in for tensorrt_llm.bindings.executor.ContextPhaseParams."""

    first_gen_tokens: List[int]
    req_id: Optional[int]
    opaque_state: Optional[bytes]
    draft_tokens: Optional[List[int]]
    ctx_dp_rank: Optional[int]
    ctx_info_endpoint: Optional[Any]


def _get_context_phase_params(self) -> ContextPhaseParams:
    own = getattr(self, "disagg_request_id", None)
    request_id = own if own is not None else self.ctx_request_id
    return ContextPhaseParams(first_gen_tokens=self.first_gen_tokens, req_id=request_id,
                              opaque_state=self.opaque_state, draft_tokens=self.draft_tokens,
                              ctx_dp_rank=getattr(self, "ctx_dp_rank", None),
                              ctx_info_endpoint=getattr(self, "ctx_info_endpoint", None))


def _post_init(self) -> None:
    if self.request_type is not None:
        self.request_type = self.request_type.lower()
        if self.request_type not in REQUEST_TYPES:
            raise ValueError(f"Unknown request type: {self.request_type}. Must be context_only, "
                             "generation_only or context_and_generation")
    handles, hashes = getattr(self, "multimodal_embedding_handles", None), getattr(self, "multimodal_hashes", None)
    if handles is not None and hashes is not None:
        assert len(handles) == len(hashes), "multimodal_embedding_handles and multimodal_hashes must have the same length"
        for mm_hash in hashes:
            assert isinstance(mm_hash, list) and len(mm_hash) == 8, "mm_hash must be a list of 8 integers"


_wanted = version_fields()
DisaggregatedParams = dataclasses.make_dataclass(
    "DisaggregatedParams",
    [(name, kind, dataclasses.field(default=None)) for name, kind in FIELDS if _wanted is None or name in _wanted],
    namespace={"get_context_phase_params": _get_context_phase_params, "__post_init__": _post_init},
    slots=True, kw_only=True)
DisaggregatedParams.__module__ = __name__
