"""The mock engine: no model; configurable prefill and per-token delays (0 allowed)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Sequence

from hpc.runtime.engine.types import (DisaggregatedParams, DisaggregationMode, EncodedMedia, EngineBase,
                                      FinishReason, GenerateOutput, GenerateRequest, KvMeta, TokenLogprob)


class MockEngine(EngineBase):
    def __init__(self, mode: DisaggregationMode, prefill_delay_ms: float = 0.0, per_token_delay_ms: float = 0.0,
                 self_address: str = "", vocab_size: int = 4096) -> None:
        self.mode = mode
        self.prefill_delay = prefill_delay_ms / 1000
        self.token_delay = per_token_delay_ms / 1000
        self.self_address = self_address
        self.vocab_size = vocab_size
        self._counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "running": 0, "waiting": 0}

    async def __aenter__(self) -> "MockEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    def _token(self, i: int, prompt: list[int]) -> int:
        # Deterministic and never a special token: ids 100.. cycle through the vocabulary.
        return 100 + (sum(prompt[-4:]) + i * 7) % (self.vocab_size - 100)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        if request.sampling.guide is not None:
            raise ValueError("the mock engine cannot constrain its output (response_format json_object, a forced "
                             "tool call); use backend torch or trtllm")
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += len(request.token_ids)
        self._counters["running"] += 1
        try:
            start = 0
            if request.disaggregated_params is not None:
                start = 1  # the prefill worker produced token 0
            elif self.prefill_delay:
                await asyncio.sleep(self.prefill_delay)
            if self.mode is DisaggregationMode.PREFILL:
                first = self._token(0, request.token_ids)
                self._counters["generated_tokens"] += 1
                params = DisaggregatedParams(request_handle="mock", prefill_address=self.self_address,
                                             first_token_id=first, prompt_length=len(request.token_ids))
                yield GenerateOutput(token_ids=[first], finished=True, finish_reason=FinishReason.LENGTH,
                                     prompt_tokens=len(request.token_ids), disaggregated_params=params,
                                     logprobs=self._logprobs(first, request.sampling.logprobs),
                                     prompt_logprobs=self._prompt(request))
                return
            n = request.sampling.max_tokens
            for i in range(start, n):
                if self.token_delay and i > start:
                    await asyncio.sleep(self.token_delay)
                self._counters["generated_tokens"] += 1
                last = i == n - 1
                token = self._token(i, request.token_ids)
                yield GenerateOutput(token_ids=[token], finished=last, finish_reason=FinishReason.LENGTH if last else None,
                                     prompt_tokens=len(request.token_ids),
                                     logprobs=self._logprobs(token, request.sampling.logprobs),
                                     prompt_logprobs=self._prompt(request) if i == start and not start else None)
        finally:
            self._counters["running"] -= 1

    @classmethod
    def _prompt(cls, request: GenerateRequest) -> list[TokenLogprob] | None:
        """The prompt's tokens after the first, scored like the answer's (echo with logprobs)."""
        k = request.sampling.prompt_logprobs
        return None if k is None else [cls._scored(t, k) for t in request.token_ids[1:]]

    @staticmethod
    def _logprobs(token: int, k: int | None) -> list[TokenLogprob] | None:
        """A fixed stand-in distribution: the chosen token at log(0.5), the next ids below it."""
        return None if k is None else [MockEngine._scored(token, k)]

    @staticmethod
    def _scored(token: int, k: int) -> TokenLogprob:
        return TokenLogprob(token_id=token, logprob=-0.6931, top_ids=[token + i for i in range(k)],
                            top_logprobs=[-0.6931 - i for i in range(k)])

    async def encode(self, pixels: Any, prompt_token_ids: Sequence[int] = ()) -> EncodedMedia:
        self._counters["requests"] += 1
        return EncodedMedia(shape=[0, 0])

    def take_handoff(self, handle: str, ipc: bool = False) -> tuple[KvMeta, bytes | memoryview]:
        return KvMeta(shape=[0], dtype="torch.float32"), b""

    def stats(self) -> dict[str, float]:
        return {**self._counters, "kv_usage": 0.0}
