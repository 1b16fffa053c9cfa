"""Typed requests and outputs shared by engines, workers and the frontend."""

from __future__ import annotations

from enum import Enum
from typing import Any, AsyncIterator, Protocol

from pydantic import BaseModel, ConfigDict, Field

from hpc.spec.recipe import RoleName


# A worker's disaggregation mode is its recipe role: one enum for both.
DisaggregationMode = RoleName


class Modality(str, Enum):
    TEXT = "text"
    MULTIMODAL = "multimodal"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Model):
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False


class DisaggregatedParams(_Model):
    """What a prefill worker hands to a decode worker: where the KV cache waits, and the first token."""

    request_handle: str
    prefill_address: str  # host:port of the prefill worker's RPC server
    first_token_id: int
    prompt_length: int


class EncodedMedia(_Model):
    """Image embeddings from an encode worker, sent on to prefill."""

    shape: list[int]
    data_b64: str


class GenerateRequest(_Model):
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    streaming: bool = True
    disaggregated_params: DisaggregatedParams | None = None
    image: str | None = None  # URL or local path (prefill/encode in multimodal mode)
    media: EncodedMedia | None = None


class GenerateOutput(_Model):
    token_ids: list[int]  # new tokens since the last output
    finished: bool = False
    finish_reason: str | None = None  # stop | length | cancelled | error
    prompt_tokens: int = 0
    disaggregated_params: DisaggregatedParams | None = None
    error: str | None = None


class Engine(Protocol):
    """Opened and closed with `async with`; generate() yields incremental outputs."""

    mode: DisaggregationMode

    async def __aenter__(self) -> "Engine": ...

    async def __aexit__(self, *exc: Any) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]: ...

    def stats(self) -> dict[str, float]: ...
