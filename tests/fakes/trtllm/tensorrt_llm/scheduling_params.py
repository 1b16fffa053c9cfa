"""Upstream: tensorrt_llm/scheduling_params.py (SchedulingParams, a kw-only slots dataclass). Modelled: the two
attention-DP fields the adapter sets; with attention_dp_relax False the executor serves the request on that rank
(tensorrt_llm/_torch/pyexecutor: the ADP router keeps a strict request on its rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(slots=True, kw_only=True)
class SchedulingParams:
    attention_dp_rank: Optional[int] = None
    attention_dp_relax: Optional[bool] = None
