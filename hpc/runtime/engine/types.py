"""The engine interface; its requests and outputs are the wire messages (hpc.runtime.serve.wire).

Every engine the worker holds (torch, TensorRT-LLM, mock, video, and the proxy of an engine in its own process)
answers the whole `Engine` protocol, so the worker asks nothing with hasattr: what differs between engines is
declared in `EngineTraits`, and `EngineBase` gives the answers of an engine that lacks a part.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from hpc.runtime.serve.wire import (  # the engine's vocabulary is the wire's
    DisaggregatedParams, EncodedMedia, FinishReason, GenerateOutput, GenerateRequest, KvMeta, SamplingParams,
    TokenLogprob, TrtllmContextParams, VideoRequest, VideoResult,
)
from hpc.spec.recipe import RoleName


__all__ = ["DisaggregatedParams", "DisaggregationMode", "EncodedMedia", "Engine", "EngineBase", "EngineTraits",
           "FinishReason", "GenerateOutput", "GenerateRequest", "KvMeta", "Modality", "SamplingParams", "TokenLogprob",
           "TrtllmContextParams"]

# A worker's disaggregation mode is its recipe role: one enum for both.
DisaggregationMode = RoleName


class Modality(str, Enum):
    TEXT = "text"
    MULTIMODAL = "multimodal"


@dataclass(frozen=True)
class EngineTraits:
    """What an engine does beyond generating text, declared by its class."""

    video: bool = False  # generate_video(), not generate(); it stops its own ranks
    own_image_loader: bool = False  # takes an image's bytes with the prompt (TensorRT-LLM's input processor)
    direct_stream: bool = False  # stream() writes each output as it arrives, nothing yielded
    lends_kv: bool = False  # handoff_ready / lend_handoff / release_handoff manage device-resident KV
    pulls_requests: bool = False  # set_intake(): its scheduler reads the request socket itself
    kv_events: bool = False  # reports each stored and removed KV block through on_kv_event


class Engine(Protocol):
    """Opened and closed with `async with`; generate() yields incremental outputs."""

    mode: DisaggregationMode
    traits: EngineTraits
    failure: str | None  # set when the engine can no longer serve; the worker watches it
    on_kv_event: Callable[[dict[str, Any]], None] | None  # set by the worker where KV events are published
    on_stats: Callable[[dict[str, Any]], None] | None

    async def __aenter__(self) -> "Engine": ...

    async def __aexit__(self, *exc: Any) -> None: ...

    def load(self) -> None: ...

    def follow(self) -> None: ...

    def stop_followers(self) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]: ...

    async def stream(self, request: GenerateRequest, deliver: Callable[[GenerateOutput], None]) -> None: ...

    async def encode(self, pixels: Any, prompt_token_ids: Sequence[int] = (), /) -> EncodedMedia: ...

    def load_image(self, data: bytes) -> Any: ...

    def take_handoff(self, handle: str, ipc: bool = False) -> tuple[KvMeta, bytes | memoryview]: ...

    def handoff_ready(self, handle: str) -> Any: ...

    def lend_handoff(self, handle: str) -> Any: ...

    def release_handoff(self, handle: str) -> None: ...

    def set_intake(self, intake: Callable[[float], None], wake: Callable[[], None]) -> None: ...

    def stats(self) -> dict[str, float]: ...

    async def fresh_stats(self) -> dict[str, float]: ...

    async def generate_video(self, request: VideoRequest, on_step: Callable[[int, int], None],
                             cancel: threading.Event) -> VideoResult: ...


class EngineBase:
    """The answers of an engine without a part: each refusal names the engine and what it lacks."""

    mode: DisaggregationMode
    traits: EngineTraits = EngineTraits()
    failure: str | None = None
    on_kv_event: Callable[[dict[str, Any]], None] | None = None
    on_stats: Callable[[dict[str, Any]], None] | None = None

    def _lacks(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"the {type(self).__name__} does not {what}")

    def load(self) -> None:
        """Ranks > 0 load before follow(); rank 0 loads in __aenter__."""
        raise self._lacks("run ranks of its own")

    def follow(self) -> None:
        raise self._lacks("run ranks of its own")

    def stop_followers(self) -> None:
        """Rank 0, done serving: its ranks > 0 leave follow() (an engine without ranks, or that stops them in
        __aexit__, has nothing to do)."""
        return None

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        raise self._lacks("generate text")

    async def stream(self, request: GenerateRequest, deliver: Callable[[GenerateOutput], None]) -> None:
        raise self._lacks("stream outputs directly")

    async def encode(self, pixels: Any, prompt_token_ids: Sequence[int] = ()) -> EncodedMedia:
        raise self._lacks("encode images")

    def load_image(self, data: bytes) -> Any:
        raise self._lacks("load images itself")

    def take_handoff(self, handle: str, ipc: bool = False) -> tuple[KvMeta, bytes | memoryview]:
        raise KeyError(handle)  # holds no KV for another worker

    def handoff_ready(self, handle: str) -> Any:
        return None  # no copy to wait for

    def lend_handoff(self, handle: str) -> Any:
        raise self._lacks("lend device-resident KV")

    def release_handoff(self, handle: str) -> None:
        return None

    def set_intake(self, intake: Callable[[float], None], wake: Callable[[], None]) -> None:
        raise self._lacks("read requests itself")

    def stats(self) -> dict[str, float]:
        return {}

    async def fresh_stats(self) -> dict[str, float]:
        return self.stats()  # an engine in this process answers at once

    async def generate_video(self, request: VideoRequest, on_step: Callable[[int, int], None],
                             cancel: threading.Event) -> VideoResult:
        raise self._lacks("generate video")
