"""What the torch engine's parts share, typed in one place: the loaded model and its KV cache, the slots, the
counters, and a row's life from its tokens to its end.

TorchEngine (engine.py) makes one EngineCore, loads the model into it, and hands it to its parts: the context
steps (context_steps.py: admission and prefill), the decode steps (decode_steps.py) and the warm-up (warmup.py).
Each part keeps its own state and is given each iteration's work as a StepPlan (sequence.py) by the scheduler.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager

import torch

from hpc.engine_args.torch_engine import TorchEngineArgs
from hpc.runtime.engine.kv import pack as kvpack
from hpc.runtime.engine.models.llama import KvCache, LlamaConfig, LlamaForCausalLM, Pipeline, TensorParallel
from hpc.runtime.engine.torch.decode_graphs import DecodeGraphs
from hpc.runtime.engine.torch.outputs import Emitter
from hpc.runtime.engine.torch.overlap import FirstTokens
from hpc.runtime.engine.torch.picking import TokenPicker
from hpc.runtime.engine.torch.prefill_graphs import PrefillGraphs
from hpc.runtime.engine.torch.prefix_cache import PrefixCache
from hpc.runtime.engine.torch.sequence import Seq
from hpc.runtime.engine.types import DisaggregatedParams, DisaggregationMode, FinishReason, TokenLogprob


def new_counters() -> dict[str, float]:
    """The scheduler's figures (TorchEngine.stats, /metrics per worker); a part adds its own on first use."""
    return {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "running": 0, "waiting": 0,
            "prompt_tokens_computed": 0, "prompt_tokens_cached": 0, "prefill_steps": 0,
            "decode_steps": 0, "idle_seconds_total": 0.0, "admit_seconds_total": 0.0,
            "idle_running_seconds_total": 0.0,  # of idle: the polls while rows were running
            "idle_waits_total": 0,  # the waits for work (no rows): a closed loop's waves or gaps
            "decode_seconds_total": 0.0, "queue_seconds_total": 0.0, "first_tokens": 0,
            "first_token_seconds_total": 0.0, "submit_seconds_total": 0.0,
            "inbox_seconds_total": 0.0,
            "store_seconds_total": 0.0,  # of admit: prompts into the prefix cache
            "finished_requests_total": 0, "finished_request_seconds_total": 0.0}


class SlotBook:
    """The KV cache's slots. A prefilled prompt's blocks wait in `unstored` until the prefix cache copies them
    (store); a slot released meanwhile is `held`, not prefilled over, until that copy is queued."""

    def __init__(self, slots: int) -> None:
        self.free: list[int] = list(range(slots))
        self.held: list[int] = []
        self.unstored: dict[int, list[int]] = {}  # slot -> its prompt, prefilled, not in the prefix cache yet

    def give_back(self, slot: int) -> None:
        (self.held if slot in self.unstored else self.free).append(slot)

    def store(self, prefix: PrefixCache | None) -> None:
        """The prefilled prompts' blocks into the prefix cache (their KV events leave together); held slots free.
        Queued on the engine's stream before the next prefill over any of their slots, the pool copy reads each
        slot before anything later writes it; decode steps write past the prompt's whole blocks."""
        prompts = [(tokens, slot) for slot, tokens in self.unstored.items()]
        self.unstored = {}
        if prefix is not None and prompts:
            prefix.store_all(prompts)
        self.free += self.held
        self.held = []


class EngineCore:
    """One engine's device, limits, loaded model and rows. The model's fields are set by TorchEngine's load."""

    cfg: LlamaConfig
    model: LlamaForCausalLM
    cache: KvCache
    picker: TokenPicker
    sampler: torch.Generator  # unseeded requests' draws, batched on the device
    matmul_params: int  # this rank's weights a step multiplies by (the embeddings are looked up): a step's FLOPs

    def __init__(self, limits: TorchEngineArgs, mode: DisaggregationMode, device: torch.device, dtype: torch.dtype,
                 world: TensorParallel, pipeline: bool) -> None:
        self.limits, self.mode, self.device, self.dtype = limits, mode, device, dtype
        # `world` is every rank of this worker (the steps are broadcast over it); with pipeline parallelism the
        # same ranks are the stages and each keeps whole layers (no tensor parallelism inside a stage)
        self.world = world
        self.pipeline = Pipeline(world.rank, world.size, world.group) if pipeline else Pipeline()
        self.tp = TensorParallel() if pipeline else world
        self.max_batch = limits.max_batch_size
        self.max_len = limits.max_seq_len  # capped by the model's positions at load
        self.token_budget = limits.max_num_tokens
        # TensorRT-LLM's overlap scheduler, on unless disable_overlap_scheduler (one rank: followers step in turn)
        self.overlap = limits.overlap_scheduler and world.size == 1
        self.counters = new_counters()
        self.slots = SlotBook(self.max_batch)
        self.first = FirstTokens(self.max_batch, device)  # prefills' first tokens, still on the device
        self.emitter: Any = Emitter()  # an engine process's link puts its own (engine_core.LinkEmitter)
        self.leaving = 0  # rows ended or cancelled since the scheduler last dropped those from its running list
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.prefix: PrefixCache | None = None

    @property
    def alone(self) -> bool:
        """One rank, one stage: no follower to broadcast a step to (a mixed pass has no broadcast kind)."""
        return self.world.size == 1 and self.pipeline.size == 1

    def on_device(self) -> ContextManager[Any]:
        """This engine's GPU as the thread's current device: Triton launches on the current device, so a worker
        on cuda:1 would hand its kernels pointers they cannot reach (the CUDA runtime keeps one per thread)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def count(self, counter: str, n: float = 1) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + n

    def clocked(self, counter: str, since: float) -> float:
        """Adds the time since `since` to a counter of the scheduler clock's phases; returns now."""
        now = time.perf_counter()
        self.count(counter, now - since)
        return now

    # ---- forward passes --------------------------------------------------------------------------
    def forward(self, kind: str, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                last_only: bool = True, last: torch.Tensor | None = None) -> torch.Tensor:
        if self.world.size > 1:
            from hpc.runtime.engine.torch.tp import broadcast_step

            broadcast_step(self.world, kind, embeds, positions, slots)
        return self.model.forward_step(embeds, positions, slots, self.cache, last_only=last_only, last=last)

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.forward("decode", self.model.embed(tokens), positions, slots)

    def packed_logits(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      prompts: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Prompts packed in one row (prefill_graphs); one rank only, so no step to broadcast."""
        return self.model.forward_step(self.model.embed(tokens[None]), positions[None], slots[None], self.cache,
                                       last=last, packed=prompts)

    # ---- a row's life ----------------------------------------------------------------------------
    def emit_token(self, seq: Seq, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Send one token; False when the sequence finished with it."""
        seq.generated += 1
        seq.last_token = token
        seq.counts[token] = seq.counts.get(token, 0) + 1
        self.counters["generated_tokens"] += 1
        seq.hold(token, logprob)
        reason = self.end_of(seq, token, seq.generated)
        if reason is not None:
            self.finish(seq, reason)
            return False
        if seq.generated == 1 or seq.generated % self.limits.stream_interval == 0:  # TensorRT-LLM's rule
            seq.send_held()  # (_handle_responses)
        return True

    def first_token(self, seq: Seq, token: int, logprob: TokenLogprob | None) -> bool:
        """Send a prompt's first token (here or once read from the device); False when it ended the request."""
        self.counted_first(seq)
        return self.emit_token(seq, token, logprob)

    def counted_first(self, seq: Seq) -> None:
        self.counters["first_tokens"] += 1  # from its arrival at the engine to its first token read
        self.counters["first_token_seconds_total"] += time.perf_counter() - seq.started

    def end_of(self, seq: Seq, token: int, generated: int) -> FinishReason | None:
        """Why `token` ends the sequence when it is its `generated`-th: STOP (EOS, a stop token, a complete
        guide), LENGTH (max_tokens, the cache's last position), or None (emit_token, and a decode step's bare
        tokens: DecodeSteps._emit_inflight)."""
        p = seq.request.sampling
        stops = generated >= p.min_tokens and ((token == self.cfg.eos_token_id and not p.ignore_eos)
                                               or token in p.stop_token_ids)
        if stops or (seq.guide is not None and seq.guide[0].complete(seq.guide[1])):  # the guide is complete
            return FinishReason.STOP
        if generated >= p.max_tokens or seq.length + 1 >= self.max_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Seq, reason: FinishReason, params: DisaggregatedParams | None = None,
               error: str | None = None) -> None:
        """The last output: the tokens still held (the last one among them), why it ended."""
        seq.send_held(finished=True, finish_reason=reason, error=error, disaggregated_params=params)
        self.counters["finished_requests_total"] += 1  # and their time here, from the inbox to this last output
        self.counters["finished_request_seconds_total"] += time.perf_counter() - seq.queued
        self.release(seq)
        drop_pending(seq)

    def release(self, seq: Seq, walking: bool = False) -> None:
        """Its slot back; the scheduler walks its rows at the next step, unless this is that walk (`walking`)."""
        if seq.slot >= 0:
            # a slot whose prompt the prefix cache has yet to copy is not prefilled over before that copy
            self.slots.give_back(seq.slot)
            seq.slot = -1
            if not walking:
                self.leaving += 1

    def still_running(self, seq: Seq) -> bool:
        """False for a row that ended, or was cancelled (its slot freed here: the scheduler's walk)."""
        if seq.cancelled and seq.slot >= 0:
            self.release(seq, walking=True)
            return False
        return seq.slot >= 0


def drop_pending(seq: Seq) -> None:
    """A handed-over KV never copied (its request ended first): its owner may free it now."""
    if isinstance(seq.imported_kv, kvpack.PendingCopy):
        seq.imported_kv.drop()
        seq.imported_kv = None
