"""A request's state while the torch engine's scheduler holds it, and which waiting prompts share a prefill step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from msgspec.structs import replace

from hpc.engine_args.scheduling import ChunkingPolicy
from hpc.runtime.engine.torch.sampling import graph_temperature
from hpc.runtime.engine.types import GenerateOutput, GenerateRequest, TokenLogprob


@dataclass(eq=False)  # a request's state: one is equal only to itself (a list's `in` by identity)
class Seq:
    request: GenerateRequest
    emit: Callable[[GenerateOutput], None]
    slot: int = -1
    length: int = 0  # tokens in the KV cache
    last_token: int = -1
    generated: int = 0
    gen: Any = None
    cancelled: bool = False
    imported_kv: Any = None  # a decode's KV from its prefill: a tensor, or kv.PendingCopy (CUDA IPC)
    media: torch.Tensor | None = None
    started: float = field(default_factory=time.perf_counter)
    queued: float = 0.0  # when it went into the scheduler's inbox (its KV, if handed over, fetched)
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> times (for the penalties)
    guide: Any = None  # (automaton, state) while the request's output is constrained (sampling.guide)
    cached: int = 0  # prompt tokens taken from the prefix cache
    reuse: bool = False  # its blocks go to the prefix cache once its prompt is prefilled
    prompt_lp: list[TokenLogprob] | None = None  # the prompt's logprobs, sent with the first output
    held: list[int] = field(default_factory=list)  # tokens not sent yet (stream_interval)
    held_lp: list[TokenLogprob] = field(default_factory=list)
    handoff: str = ""  # on a prefill worker: the handle its KV waits under for the decode worker
    outputs: Any = None  # where its outputs go (a queue, a callback, an engine process's key): the emitter's
    # set by the engine on submit: its tokens need not come to the host before its next step (no penalties, guides,
    # seeds, logprobs: TokenPicker.batchable); and with every token streamed, a decode step's token may leave bare
    # (Emitter.send_tokens)
    batchable: bool = False
    plain: bool = False
    ends_on: frozenset[int] = frozenset()  # a plain row's tokens that stop it (EOS unless ignored, stop tokens)
    graph_temperature: float | None = None  # its temperature where a decode graph's pick can draw it (no top-k/p)
    max_tokens: int = field(init=False, default=0)  # the request's, read by every decode step for every row
    streamed: bool = False  # an output left already (it carried what a bare token leaves out: cached tokens)

    def __post_init__(self) -> None:
        self.max_tokens = self.request.sampling.max_tokens

    def decode_facts(self, batchable: bool, stream_interval: int, eos_token_id: int, vocab: int) -> None:
        """What a decode step asks of this row at every step, made once (the engine's _seq): whether its tokens
        may stay on the device (`batchable`) and leave bare (`plain`: every token streamed); a plain row's tokens
        that stop it, EngineCore.end_of's test without a guide (a decode step's bare tokens asked it of 64 rows a step);
        its temperature for a graph's pick."""
        p = self.request.sampling
        self.batchable = batchable
        self.plain = batchable and stream_interval == 1
        if self.plain:
            self.ends_on = frozenset(p.stop_token_ids) | ({eos_token_id} if not p.ignore_eos else set())
        self.graph_temperature = graph_temperature(p, vocab)

    def hold(self, token: int, logprob: TokenLogprob | None) -> None:
        self.held.append(token)
        if logprob is not None:
            self.held_lp.append(logprob)

    def send_held(self, **final: Any) -> None:
        """An output with the tokens held so far (their logprobs, the prompt's on the first); `final` for the last
        (finished, finish_reason, error, disaggregated_params)."""
        tokens, logprobs = self.held, self.held_lp or None
        self.held, self.held_lp = [], []
        prompt_lp, self.prompt_lp = self.prompt_lp, None
        self.streamed = True
        out = GenerateOutput(token_ids=tokens, prompt_tokens=len(self.request.token_ids), logprobs=logprobs,
                             cached_tokens=self.cached, prompt_logprobs=prompt_lp)
        # not `**final` in the call above: even empty, it takes msgspec's slow path (0.8 µs a token instead of 0.15)
        self.emit(replace(out, **final) if final else out)

    def bare(self, tokens: list[int]) -> GenerateOutput:
        """Plain decode tokens' output, as send_held makes it (Emitter.send_tokens)."""
        return GenerateOutput(token_ids=tokens, prompt_tokens=len(self.request.token_ids), cached_tokens=self.cached)


class BatchWait:
    """TensorRT-LLM's batch waiting (batch_wait_timeout_iters, batch_wait_max_tokens_ratio; PyExecutor's
    _waiting_requests in tensorrt_llm/_torch/pyexecutor/py_executor.py): while sequences decode, new prompts wait
    until they and the decoding rows make `ratio` x max_num_tokens tokens, or for `timeout_iters` steps at most,
    so that prompts arriving one by one are prefilled together instead of each stopping the decode for a step
    of its own. Off when both are 0 (the default); nothing waits when nothing decodes. As there, both are
    needed: a ratio of 0 is always reached, so the steps alone hold nothing back."""

    def __init__(self, timeout_iters: int, max_tokens_ratio: float, max_num_tokens: int) -> None:
        self.enabled = timeout_iters > 0 or max_tokens_ratio > 0
        self.timeout_iters = timeout_iters
        self.threshold = max_tokens_ratio * max_num_tokens
        self.waited = 0  # steps the current arrivals have waited

    def admit_now(self, arrivals: list[Seq], decoding: int) -> bool:
        if not self.enabled or not arrivals or not decoding:
            return True
        tokens = sum(len(seq.request.token_ids) for seq in arrivals) + decoding
        if self.waited >= self.timeout_iters or tokens >= self.threshold:
            self.waited = 0
            return True
        self.waited += 1
        return False


def chunkable(request: GenerateRequest) -> bool:
    """A prompt with media (its image tokens take the encoder's rows in one pass) or asking for the prompt's
    logprobs (every position's logits at once) is prefilled whole."""
    return request.media is None and request.sampling.prompt_logprobs is None


def wanted_prompt_logprobs(request: GenerateRequest) -> int | None:
    """How many logprobs the request wants for each prompt token (None: none; a one-token prompt has none)."""
    return request.sampling.prompt_logprobs if len(request.token_ids) > 1 else None


def remaining(seq: Seq) -> int:
    """Prompt tokens not in the KV cache yet (after a prefix-cache hit and the chunks prefilled so far)."""
    return len(seq.request.token_ids) - seq.length


def context_work(waiting: list[Seq], capacity: int, chunking: ChunkingPolicy | None,
                 unit: int) -> list[tuple[Seq, int]]:
    """The prompt tokens one step prefills, (sequence, tokens) in arrival order, within `capacity` (the step's
    max_num_tokens less a token per decoding row) — TensorRT-LLM's micro-batch scheduler for context requests
    (PyMicroBatchScheduler in tensorrt_llm/_torch/pyexecutor/scheduler.py). Without chunking a prompt goes whole
    or waits, and the prompts behind it with it. With chunking, when not all fit: FIRST_COME_FIRST_SERVED gives
    each in turn what is left, cut to a multiple of `unit` (tokens_per_block) unless it is the prompt's end;
    EQUAL_PROGRESS adds `unit` tokens to each in turn while they fit. A prompt that cannot be chunked goes whole
    or waits, as without chunking."""
    if chunking is None or sum(map(remaining, waiting)) <= capacity:
        work, used = [], 0
        for seq in waiting:
            if used + remaining(seq) > capacity:
                break
            work.append((seq, remaining(seq)))
            used += remaining(seq)
        return work
    sizes = dict.fromkeys(range(len(waiting)), 0)
    if chunking is ChunkingPolicy.FIRST_COME_FIRST_SERVED:
        left = capacity
        for i, seq in enumerate(waiting):
            size = remaining(seq) if remaining(seq) <= left else (left // unit) * unit if chunkable(seq.request) else -1
            if size < 0:  # whole or not at all: it and those behind it wait
                break
            sizes[i], left = size, left - size
            if left <= 0:
                break
    else:
        used, progressed = 0, True
        while used < capacity and progressed:
            progressed = False
            for i, seq in enumerate(waiting):
                step = min(unit, remaining(seq) - sizes[i]) if chunkable(seq.request) else remaining(seq) - sizes[i]
                if step > 0 and used + step <= capacity:
                    sizes[i], used, progressed = sizes[i] + step, used + step, True
    return [(seq, sizes[i]) for i, seq in enumerate(waiting) if sizes[i] > 0]


PrefillGroup = tuple[tuple[Seq, int], ...]  # (sequence, prompt tokens) prefilled in one forward pass


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One scheduler iteration's work, decided before any of it runs (as vLLM's SchedulerOutput): the prompt
    tokens, in forward passes (ContextSteps.run), then a decode step over `decode`, joined by the rows whose
    prompt ended in this prefill (DecodeSteps.run)."""
    prefill: tuple[PrefillGroup, ...] = ()
    decode: tuple[Seq, ...] = ()


def fresh_first(group: PrefillGroup) -> PrefillGroup:
    """The group's prompts from position 0 first, then those going on from their cache, each in arrival order."""
    return tuple(sorted(group, key=lambda item: item[0].length > 0))


def prefill_groups(work: list[tuple[Seq, int]], budget: int, pipeline: bool) -> Iterator[list[tuple[Seq, int]]]:
    """Prompt chunks prefilled in one forward pass, their padded tokens within `budget`. Alone: a prompt with
    media or asking for the prompt's logprobs, and every prompt of a pipeline (only its last stage holds the
    logits' rows)."""
    group: list[tuple[Seq, int]] = []
    width = 0
    for seq, n in work:
        alone = not chunkable(seq.request) or pipeline
        if group and (alone or max(width, n) * (len(group) + 1) > budget):
            yield group
            group, width = [], 0
        if alone:
            yield [(seq, n)]
            continue
        group.append((seq, n))
        width = max(width, n)
    if group:
        yield group
