"""The engine interface; its requests and outputs are the wire messages (hpc.runtime.serve.wire)."""

from __future__ import annotations

from enum import Enum
from typing import Any, AsyncIterator, Protocol

from hpc.runtime.serve.wire import (  # the engine's vocabulary is the wire's
    DisaggregatedParams, EncodedMedia, GenerateOutput, GenerateRequest, KvMeta, SamplingParams, TokenLogprob,
    TrtllmContextParams,
)
from hpc.spec.recipe import RoleName


__all__ = ["DisaggregatedParams", "DisaggregationMode", "EncodedMedia", "Engine", "GenerateOutput", "GenerateRequest",
           "KvMeta", "Modality", "SamplingParams", "TokenLogprob", "TrtllmContextParams"]

# A worker's disaggregation mode is its recipe role: one enum for both.
DisaggregationMode = RoleName


class Modality(str, Enum):
    TEXT = "text"
    MULTIMODAL = "multimodal"


class Engine(Protocol):
    """Opened and closed with `async with`; generate() yields incremental outputs."""

    mode: DisaggregationMode

    async def __aenter__(self) -> "Engine": ...

    async def __aexit__(self, *exc: Any) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]: ...

    def stats(self) -> dict[str, float]: ...
