"""Upstream: tensorrt_llm/executor/result.py.

Modelled: CompletionOutput with *cumulative* `token_ids` and the `token_ids_diff` property (new ids since the
last response); `finish_reason` in 'stop' | 'length' | 'timeout' | 'cancelled' and `stop_reason`; stop words
trimmed from token_ids unless include_stop_str_in_output; the context phase's DisaggregatedParams
(request_type context_only, first_gen_tokens, ctx_request_id, opaque_state, draft_tokens) attached to each
output; in a streaming generation-only request the first token is left out of the diff at decoding_iter 2
("already returned by the context server"); GenerationResult.abort() -> executor.abort_request(id), a request
that is aborted ends with finish_reason 'cancelled'; `async for` over a result and `await result.aresult()`;
IterationResult: an async iterator over queued stats/events that stops after `timeout` seconds without one.
Errors (GenerationResultBase._handle_response -> GenerationExecutor._handle_background_error in
tensorrt_llm/executor/executor.py): a response's error_msg is a per-request error raised as RequestError; after
every response the executor's error queue is checked, and a queued background exception (a dead executor
thread or MPI worker) shuts the executor down and is raised as is.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(slots=True)
class Logprob:
    """Upstream: a token's log-probability and its vocabulary rank (1 = most likely)."""

    logprob: float
    rank: Optional[int] = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: Optional[list[int]] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list] = field(default_factory=list)
    prompt_logprobs: Optional[list] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Any] = None
    generation_logits: Any = None
    disaggregated_params: Any = None
    _last_text_len: int = field(default=0, init=False, repr=False)
    _last_token_ids_len: int = field(default=0, init=False, repr=False)
    _last_logprobs_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def logprobs_diff(self) -> list:
        return self.logprobs[self._last_logprobs_len:]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]


@dataclass
class Response:
    """Stands in for one tensorrt_llm.bindings.executor.Response (one scheduler iteration)."""

    new_token_ids: list[int]
    decoding_iter: int
    is_final: bool = False
    finish_reason: Optional[str] = None  # END_ID | STOP_WORDS | LENGTH | CANCELLED
    context_phase_params: Any = None
    error: Optional[str] = None
    # per new token {token_id: Logprob} for the `logprobs` most likely and the sampled one (upstream: at most
    # logprobs + 1 entries); a generation-only request has none for the first token (the context phase made it)
    new_logprobs: list = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: {token_id: Logprob} per prompt token after the first (context phase)
    prompt_logprobs: list = field(default_factory=list)


class GenerationResult:
    def __init__(self, request_id: int, prompt_token_ids: list[int], sampling_params, streaming: bool,
                 executor, disaggregated_params=None) -> None:
        self.request_id = request_id
        self.id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self._streaming = streaming
        self._executor = executor
        self.disaggregated_params = disaggregated_params
        self.decoding_iter = 0
        self._done = False
        self._aborted = False
        self._outputs = [CompletionOutput(i) for i in range(sampling_params.best_of)]
        self.aqueue: asyncio.Queue = asyncio.Queue()  # upstream requires a running event loop too
        self.mm_embedding_handle = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs[: self.sampling_params.n]

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        assert self._executor is not None, "The executor is not set for this result."
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _handle_response(self, response: Response) -> None:
        if response.error:
            from tensorrt_llm.executor.utils import RequestError

            raise RequestError(response.error)
        self._executor.raise_background_error()
        self._done = response.is_final
        self.decoding_iter = response.decoding_iter
        if response.context_phase_params is not None:
            from tensorrt_llm.disaggregated_params import DisaggregatedParams

            cpp = response.context_phase_params
            sent = self.disaggregated_params
            # the encoder's M-RoPE handles go on to the generation phase with the context's parameters
            mrope = {k: getattr(sent, k) for k in ("mrope_position_ids_handle", "mrope_position_deltas_handle")
                     if getattr(sent, k, None) is not None}
            self.disaggregated_params = DisaggregatedParams(
                request_type="context_only", first_gen_tokens=cpp.first_gen_tokens, ctx_request_id=cpp.req_id,
                opaque_state=cpp.opaque_state, draft_tokens=cpp.draft_tokens, **mrope)
        output = self._outputs[0]
        output.disaggregated_params = self.disaggregated_params
        output._last_token_ids_len = len(output.token_ids)
        output.token_ids.extend(response.new_token_ids)
        if response.prompt_logprobs:
            output.prompt_logprobs = list(response.prompt_logprobs)
        if response.new_logprobs:
            output._last_logprobs_len = len(output.logprobs)
            output.logprobs = output.logprobs + response.new_logprobs
        dp = self.disaggregated_params
        if dp is not None and dp.request_type == "generation_only" and self._streaming and self.decoding_iter == 2:
            output._last_token_ids_len = 1
        if response.finish_reason == "CANCELLED":
            output.finish_reason = "cancelled"
        if self._done:
            reason = response.finish_reason
            if reason == "END_ID":
                output.finish_reason = "stop"
            elif reason == "STOP_WORDS":
                output.finish_reason = "stop"
                for stop_reason, stop_ids in self.sampling_params._get_stop_reasons_and_words():
                    if stop_ids and output.token_ids[-len(stop_ids):] == stop_ids:
                        output.stop_reason = stop_reason
                        if not self.sampling_params.include_stop_str_in_output:
                            output.token_ids = output.token_ids[:-len(stop_ids)]
                        break
            elif reason == "LENGTH":
                output.finish_reason = "length"
            elif reason != "CANCELLED":
                raise ValueError(f"Unknown finish reason: {reason}")

    async def _aresult_step(self) -> None:
        self._handle_response(await self.aqueue.get())

    async def aresult(self) -> "GenerationResult":
        while not self._done:
            await self._aresult_step()
        return self

    def __await__(self):
        return self.aresult().__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        await self._aresult_step()
        return self


class IterationResult:
    def __init__(self, source: "asyncio.Queue[str]", timeout: float) -> None:
        self._source = source
        self._timeout = timeout
        self._done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self._done:
            raise StopAsyncIteration
        try:
            data = await asyncio.wait_for(self._source.get(), self._timeout)
        except asyncio.TimeoutError:
            self._done = True
            raise StopAsyncIteration from None
        return json.loads(data)
