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
    max_tokens: int = Field(16, ge=1, le=10_000_000)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000)
    seed: int | None = Field(None, ge=0, lt=2**63)  # engines seed 64-bit generators
    stop_token_ids: list[int] = Field(default_factory=list)
    stop: list[str] = Field(default_factory=list)  # stop strings, for engines that stop on them themselves
    ignore_eos: bool = False


class TrtllmContextParams(_Model):
    """TensorRT-LLM's context-phase parameters (tensorrt_llm/disaggregated_params.py), carried prefill -> decode.

    The generation-only request needs all of them: the C++ executor finds the context's KV cache through the
    cache transceiver by request id, and the prompt must be the one the context phase ran.
    """

    first_gen_tokens: list[int]
    ctx_request_id: int | None = None
    disagg_request_id: int | None = None
    opaque_state_b64: str | None = None
    draft_tokens: list[int] | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    prompt_token_ids: list[int]


class DisaggregatedParams(_Model):
    """What a prefill worker hands to a decode worker: where the KV cache waits, and the first token."""

    request_handle: str
    prefill_address: str  # host:port of the prefill worker's RPC server
    first_token_id: int
    prompt_length: int
    trtllm: TrtllmContextParams | None = None


class EncodedMedia(_Model):
    """Image embeddings from an encode worker, sent on to prefill: the tensor itself (torch engine), or
    TensorRT-LLM's multimodal embedding handles (CUDA IPC, so encode and prefill share a node)."""

    shape: list[int] = Field(default_factory=list)
    data_b64: str = ""
    handles: list[dict[str, Any]] | None = None
    hashes: list[list[int]] | None = None


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
