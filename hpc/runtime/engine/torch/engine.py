"""The torch reference engine: a KV cache in slots, iteration-level batching, streaming, cancellation.

One scheduler thread owns the model. Each iteration it admits the waiting requests that fit a slot, plans the
step (sequence.StepPlan: the prompt tokens that fit max_num_tokens, in forward passes; with
enable_chunked_prefill a long prompt a chunk per iteration), has the context steps prefill them
(context_steps.py), then the decode steps run one batched step over every running request (decode_steps.py).
The parts share the engine's core (core.py: the model, the cache, the slots, the counters). With tensor
parallelism, rank 0 runs the scheduler and broadcasts each step to the follower ranks, which run the same
forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncGenerator, Callable, Sequence

import torch

from hpc.model.info import ModelInfo
from hpc.engine_args.torch_engine import TorchEngineArgs
from hpc.spec.recipe import TorchEngineSpec
from hpc.runtime.engine.kernels import fused_decode
from hpc.runtime.engine.kv import pack as kvpack
from hpc.runtime.engine.torch.decode_graphs import DecodeGraphs
from hpc.runtime.engine.models.llama import (LlamaConfig, LlamaForCausalLM, TensorParallel, VisionEncoder,
                                             random_state, shard_state_dict, stage_state_dict)
from hpc.runtime.engine.models.moe import ExpertParallel, expert_state_dict
from hpc.runtime.engine.torch.outputs import Direct
from hpc.runtime.engine.torch.picking import TokenPicker
from hpc.runtime.engine.torch.prefix_cache import PrefixCache
from hpc.runtime.engine.torch.kv_records import KvRecord, publish_each
from hpc.runtime.engine.torch.prefill_graphs import PrefillGraphs
from hpc.runtime.engine.torch.context_steps import ContextSteps
from hpc.runtime.engine.torch.core import EngineCore
from hpc.runtime.engine.torch.cpu_reference import CpuReference
from hpc.runtime.engine.torch.decode_steps import DecodeSteps
from hpc.runtime.engine.torch.warmup import warm_up
from hpc.runtime.engine.torch.mixed_steps import MixedSteps
from hpc.runtime.engine.torch.sequence import BatchWait, Seq, StepPlan, chunkable, remaining
from hpc.runtime.engine.types import (DisaggregatedParams, DisaggregationMode, EncodedMedia, EngineBase, EngineTraits,
                                      FinishReason, GenerateOutput, GenerateRequest, KvMeta)
from hpc.runtime.engine.torch.sampling import pick_in_graph, prepare_pinned_copies

log = logging.getLogger(__name__)
HANDOFF_TTL_S = 120.0
INTAKE_WAIT_S = 0.05  # an idle scheduler's wait for its own requests (intake): also how soon it sees close()
STORE_AFTER_PROMPTS = 64  # a busy prefill worker stores its prompts at the latest once this many wait (_store_due)


# the LLM API's `dtype` (TensorRT-LLM llmapi/llm_args.py): "auto" is bf16 on a GPU, fp32 on the CPU
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SWITCHES = TorchEngineSpec()  # an engine made without a recipe's torch_engine section (tests, benchmarks)


class TorchEngine(EngineBase):
    traits = EngineTraits(direct_stream=True, lends_kv=True, pulls_requests=True, kv_events=True)

    def __init__(self, model_dir: Path, mode: DisaggregationMode, engine_args: dict[str, Any], *,
                 device: str | None = None, tp: TensorParallel | None = None,
                 fetch_kv: Callable[[DisaggregatedParams], Any] | None = None,
                 self_address: str = "", canned_completion: str | None = None, pipeline: bool = False,
                 expert_parallel: bool = False, switches: TorchEngineSpec | None = None) -> None:
        self.model_dir = Path(model_dir).expanduser()
        self.canned_completion = canned_completion
        self.mode = mode
        self.args = dict(engine_args)  # a copy: the caller's dict is never changed
        self.limits = TorchEngineArgs.read(self.args)
        self.switches = switches or DEFAULT_SWITCHES  # the recipe's torch_engine section
        on = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = _DTYPES.get(self.limits.dtype) or (torch.bfloat16 if on.type == "cuda" else torch.float32)
        world = tp or TensorParallel()
        self.core = EngineCore(self.limits, mode, on, dtype, world, pipeline)
        # expert parallelism: the TP ranks also split the experts (EP == TP); attention stays tensor-parallel
        self.ep = ExpertParallel(world.rank, world.size, world.group) if expert_parallel else ExpertParallel()
        self.handoffs = kvpack.HeldKv(HANDOFF_TTL_S)  # prefill: KV waiting for its decode worker
        self.context = ContextSteps(self.core, self.handoffs, self_address)
        self.decode = DecodeSteps(self.core)
        self.mixed = MixedSteps(self.core, self.context, self.decode, self.switches.mixed_steps)
        self.batch_wait = BatchWait(self.limits.batch_wait_timeout_iters, self.limits.batch_wait_max_tokens_ratio,
                                    self.limits.max_num_tokens)
        self._deferred: list[Seq] = []  # arrivals the batch wait holds back
        self._prefilling: list[Seq] = []  # admitted, their prompts not all in the KV cache yet
        self.cpu_reference = CpuReference()  # the speed of the CPU under the scheduler thread, timed on it
        self.fetch_kv = fetch_kv
        self.loaded = False
        self.vision: VisionEncoder | None = None
        self._inbox: queue.Queue[Seq | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._scheduling = threading.Event()  # the scheduler thread is set up
        self._running = False
        self.failure: str | None = None  # set when the scheduler thread dies
        self.warmed: list[tuple[str, int]] = []
        self.warmup_s = 0.0
        self.on_kv_event: Callable[[dict[str, Any]], None] | None = None  # TensorRT-LLM's stored/removed records,
        # on the loop that opened the engine; or on_kv_events: a step's KvRecords at once, on the scheduler's thread
        self.on_kv_events: Callable[[list[KvRecord]], None] | None = None
        # an engine process's (engine_core): called by the scheduler at every turn with how long it may wait for a
        # request; it reads the process's requests and submits them (submit_now) on the scheduler's own thread
        self.intake: Callable[[float], None] | None = None
        self._wake_intake: Callable[[], None] | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None

    @property
    def device(self) -> torch.device:
        return self.core.device

    # ---- lifecycle -------------------------------------------------------------------------------
    async def __aenter__(self) -> "TorchEngine":
        self._event_loop = asyncio.get_running_loop()
        if self.switches.gil_switch_interval_s is not None:  # this process's, for every thread in it
            sys.setswitchinterval(self.switches.gil_switch_interval_s)
        await asyncio.to_thread(self.load)
        self._running = True
        if self.mode is not DisaggregationMode.ENCODE:
            self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
            self._thread.start()
            await asyncio.to_thread(self._scheduling.wait, 60)  # its own buffers made before anyone is served
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._running = False
        self._inbox.put(None)
        self._woken()
        if self._thread:
            await asyncio.to_thread(self._thread.join, 10)

    def on_device(self) -> Any:
        return self.core.on_device()

    def load(self) -> None:
        with self.on_device():
            self._load()

    def follow(self) -> None:
        """Ranks > 0: run every forward pass rank 0 broadcasts, until it says stop."""
        from hpc.runtime.engine.torch.tp import follow

        follow(self.core)

    def stop_followers(self) -> None:
        if self.core.world.size > 1:
            from hpc.runtime.engine.torch.tp import broadcast_stop

            broadcast_stop(self.core.world, self.core.device)

    def _load(self) -> None:
        from safetensors.torch import load_file

        core = self.core
        cfg = LlamaConfig.load(self.model_dir)
        if self.mode in (DisaggregationMode.ENCODE, DisaggregationMode.AGGREGATED, DisaggregationMode.PREFILL) \
                and cfg.vision and (self.model_dir / "vision.safetensors").is_file():
            v = cfg.vision
            self.vision = VisionEncoder(cfg.hidden_size, v["image_size"], v["patch_size"])
            self.vision.load_state_dict(load_file(str(self.model_dir / "vision.safetensors")))
            self.vision.to(core.device, core.dtype).eval()
        core.cfg = cfg
        if self.mode is DisaggregationMode.ENCODE:
            return
        core.model = self._load_model(cfg)
        self._log_placement(cfg)
        core.max_len = min(core.max_len, cfg.max_position_embeddings)
        sizes = self.limits.decode_graphs if self._graphable() else None
        switches = self.switches
        core.graphs = DecodeGraphs(core.decode_logits, sizes, core.max_batch, core.device, pick=pick_in_graph,
                                   copies_in_graph=switches.decode_graph_copies,
                                   steps=switches.decode_steps_per_graph) if sizes else None
        core.matmul_params = sum(p.numel() for n, p in core.model.named_parameters() if "embed_tokens" not in n)
        counts = self.limits.prefill_graph_tokens if self._graphable(prefill=True) else None
        core.prefill_graphs = PrefillGraphs(core.packed_logits, counts, core.max_batch, core.max_batch,
                                            core.max_len, core.device) if counts else None
        # one slot more with graphs: padded rows and tokens write their K/V there
        core.cache = core.model.new_cache(core.max_batch + bool(sizes or counts), core.max_len, core.dtype,
                                          core.device)
        core.picker = TokenPicker(self.model_dir, cfg.eos_token_id, core.max_len, self.canned_completion)
        core.prefix = self._prefix_cache()
        core.sampler = torch.Generator(device=core.device)
        # not torch.seed(): it reseeds every GPU's default generator, other engines' in this process too
        core.sampler.manual_seed(random.getrandbits(63))
        self.loaded = True
        self.warmed, self.warmup_s = warm_up(core)

    def _load_model(self, cfg: LlamaConfig) -> LlamaForCausalLM:
        """This rank's part of the model (its TP shard, pipeline stage and experts), on the device, fused."""
        from safetensors.torch import load_file

        core = self.core
        if self.ep.size > 1 and not cfg.moe:
            raise ValueError(f"expert parallelism {self.ep.size} needs a mixture-of-experts model; "
                             f"{self.model_dir}/config.json has no num_local_experts")
        seeded = ModelInfo.read(self.model_dir).random_weights
        if seeded:  # a model of real shapes whose weights are made here, on the device (hpc model llama-8b-shape)
            with torch.device("meta"):
                model = LlamaForCausalLM(cfg, core.tp, core.pipeline, self.ep)
            full = random_state(cfg, core.device, core.dtype, int(seeded.get("seed", 0)))
        else:
            model = LlamaForCausalLM(cfg, core.tp, core.pipeline, self.ep)
            full = load_file(str(self.model_dir / "model.safetensors"))
        full = expert_state_dict(full, self.ep, cfg.num_local_experts)
        full = shard_state_dict(full, core.tp, experts_whole=self.ep.size > 1)
        model.load_state_dict(stage_state_dict(full, cfg, core.pipeline), assign=bool(seeded))
        loaded = model.to(core.device, core.dtype).eval().fuse_projections()
        del full, model
        if core.device.type == "cuda":
            torch.cuda.empty_cache()  # the unfused projections' blocks, for another worker sharing the GPU
        if fused_decode.available(cfg, core.device) and core.pipeline.size == 1:
            loaded.enable_fused_decode()
        return loaded

    def _log_placement(self, cfg: LlamaConfig) -> None:
        core = self.core
        log.info("torch engine on %s (%s), TP rank %d of %d, fused decode kernels: %s", core.device, core.dtype,
                 core.tp.rank, core.tp.size, "on" if core.model.fused_decode else "off")
        if self.ep.size > 1:
            own = self.ep.experts(cfg.num_local_experts)
            log.info("expert-parallel rank %d of %d: experts %d-%d", self.ep.rank, self.ep.size, own.start,
                     own.stop - 1)
        if core.pipeline.size > 1:
            own = core.pipeline.layers(cfg.num_hidden_layers)
            log.info("pipeline stage %d of %d: layers %d-%d", core.pipeline.rank, core.pipeline.size, own.start,
                     own.stop - 1)

    def _graphable(self, prefill: bool = False) -> bool:
        """Steps worth capturing: one rank (collectives stay eager), no expert routing (data-dependent token
        counts); decode: this worker decodes (a prefill worker never does) on the fused path's graph-safe
        attention; prefill: this worker prefills (a decode worker takes its KV from one)."""
        core = self.core
        if core.device.type != "cuda" or core.world.size > 1 or core.cfg.moe:
            return False
        if prefill:
            return self.mode in (DisaggregationMode.AGGREGATED, DisaggregationMode.PREFILL)
        return self.mode is not DisaggregationMode.PREFILL and core.model.fused_decode is not None

    def _prefix_cache(self) -> PrefixCache | None:
        """Prefix reuse as TensorRT-LLM's kv_cache_config sets it: on unless enable_block_reuse is false, blocks
        of tokens_per_block (32), a pool of max_tokens (8 x max_seq_len). Prefill and aggregated workers of one
        rank only: a decode worker takes its KV from prefill, and the ranks of a parallel worker would all have
        to copy the same blocks."""
        core = self.core
        if not self.limits.block_reuse or core.world.size > 1 or self.mode not in (
                DisaggregationMode.AGGREGATED, DisaggregationMode.PREFILL):
            return None
        block = self.limits.tokens_per_block
        capacity = (self.limits.kv_max_tokens or 8 * core.max_len) // block
        return PrefixCache(block, max(1, capacity), core.cache, on_events=self._kv_events_out)

    def _kv_events_out(self, records: list[KvRecord]) -> None:
        """A prefill step's records, from the scheduler thread to whoever listens: all at once to on_kv_events, on
        this thread (an engine process's link: one message, as they are); else each to on_kv_event (the worker's
        NATS publisher) in TensorRT-LLM's form, made on its event loop, in one wake-up."""
        if self.on_kv_events is not None:
            self.on_kv_events(records)
            return
        listener, loop = self.on_kv_event, self._event_loop
        if listener is not None and loop is not None:
            loop.call_soon_threadsafe(publish_each, listener, records)

    # ---- public API ------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        outputs: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        seq = await self.submit(request, outputs)
        try:
            while True:
                out = await outputs.get()
                yield out
                if out.finished:
                    return
        finally:
            self.cancel(seq)  # client went away or the stream ended: the scheduler frees the slot

    async def stream(self, request: GenerateRequest, deliver: Callable[[GenerateOutput], None]) -> None:
        """generate() without a task wake-up and a generator resumption per token: each output goes to `deliver`
        (on this loop) as its decode step's batch arrives — the worker's RPC writes the frame right there, 3-4x
        less event-loop time per token, which the engine thread gets back (they share the GIL). Returns when the
        request finished; raises what `deliver` raised."""
        done = asyncio.get_running_loop().create_future()

        def put(out: GenerateOutput) -> None:
            if done.done():  # cancelled or failed: the scheduler's last outputs have nowhere to go
                return
            try:
                deliver(out)
            except Exception as exc:  # noqa: BLE001 - the caller's error, raised from stream()
                done.set_exception(exc)
                return
            if out.finished:
                done.set_result(None)

        seq = await self.submit(request, Direct(put))
        try:
            await done
        finally:
            self.cancel(seq)
            if not done.done():
                done.cancel()

    async def submit(self, request: GenerateRequest, outputs) -> Seq:
        """Check the request, fetch its KV (decode), hand it to the scheduler; its outputs go to `outputs` through
        the core's emitter (generate and stream; an engine process's link sends them to its worker instead)."""
        loop = asyncio.get_running_loop()
        seq = self._seq(request, loop, outputs)
        self._check(request)
        params = request.disaggregated_params
        if params is not None and self.imports_kv(request):
            if self.fetch_kv is None:
                raise RuntimeError("decode engine has no KV fetcher")
            seq.imported_kv = await self.fetch_kv(params)
        return self._enqueue(seq)

    def submit_now(self, request: GenerateRequest, outputs, imported_kv: Any = None) -> Seq:
        """submit() with nothing to await, from any thread: a decode's KV already in hand (`imported_kv`). An
        engine process's scheduler thread reads its own requests and submits them this way (engine_core)."""
        seq = self._seq(request, None, outputs)
        self._check(request)
        seq.imported_kv = imported_kv
        return self._enqueue(seq)

    def _seq(self, request: GenerateRequest, loop: Any, outputs: Any) -> Seq:
        core = self.core
        seq = Seq(request=request, emit=lambda out: core.emitter.send(loop, outputs, out), outputs=outputs)
        if self.loaded:
            seq.decode_facts(core.picker.batchable(request.sampling), self.limits.stream_interval,
                             core.cfg.eos_token_id, core.cfg.vocab_size)
        return seq

    def set_intake(self, intake: Callable[[float], None], wake: Callable[[], None]) -> None:
        """`wake` ends the intake's wait: what another thread puts in the inbox is not left waiting for it."""
        self.intake, self._wake_intake = intake, wake
        self._inbox.put(None)  # a scheduler waiting on the inbox wakes, and waits on the intake from then on

    def _woken(self) -> None:
        if self._wake_intake is not None and threading.current_thread() is not self._thread:
            self._wake_intake()

    def imports_kv(self, request: GenerateRequest) -> bool:
        """A decode engine's request whose KV a prefill worker holds."""
        return request.disaggregated_params is not None and self.mode is DisaggregationMode.DECODE

    def _check(self, request: GenerateRequest) -> None:
        if self.failure:
            raise RuntimeError(f"engine failed: {self.failure}")
        self._validate(request)

    def _enqueue(self, seq: Seq) -> Seq:
        request = seq.request
        if request.media is not None:
            seq.media = torch.frombuffer(bytearray(request.media.data),
                                         dtype=torch.float32).reshape(request.media.shape)
        self.core.counters["waiting"] += 1
        seq.queued = time.perf_counter()
        self.core.counters["submit_seconds_total"] += seq.queued - seq.started  # checks, the KV fetched
        self._inbox.put(seq)
        self._woken()
        return seq

    def _validate(self, request: GenerateRequest) -> None:
        core = self.core
        if not request.token_ids:
            raise ValueError("empty prompt")
        if len(request.token_ids) + request.sampling.max_tokens > core.max_len:
            raise ValueError(f"prompt ({len(request.token_ids)} tokens) + max_tokens "
                             f"({request.sampling.max_tokens}) exceeds max_seq_len {core.max_len}")
        if self.loaded and max(request.token_ids) >= core.cfg.vocab_size:
            raise ValueError("token id outside the vocabulary")
        whole = self.limits.chunking is None or not chunkable(request)
        if whole and not self.imports_kv(request) and len(request.token_ids) > core.token_budget:
            # as TensorRT-LLM's LLM API refuses it (_check_arguments): one step could never hold the prompt
            raise ValueError(f"prompt ({len(request.token_ids)} tokens) exceeds max_num_tokens "
                             f"({core.token_budget}); set enable_chunked_prefill: true or raise max_num_tokens")
        if request.sampling.prompt_logprobs is not None and core.pipeline.size > 1:
            raise ValueError("the prompt's logprobs are not computed across pipeline stages")

    async def encode(self, pixels: torch.Tensor, prompt_token_ids: Sequence[int] = ()) -> EncodedMedia:
        """The image's embeddings (the vision tower reads no text: the prompt is not needed)."""
        if self.vision is None:
            raise RuntimeError("this model has no vision encoder")
        vision, core = self.vision, self.core
        emb = await asyncio.to_thread(lambda: vision(pixels.to(core.device, core.dtype)).float().cpu())
        core.counters["requests"] += 1
        return EncodedMedia(shape=list(emb.shape), data=emb.numpy().tobytes())

    def take_handoff(self, handle: str, ipc: bool = False) -> tuple[KvMeta, bytes | memoryview]:
        """The prefilled KV of `handle` (kv.HeldKv.take): as bytes, or shared over CUDA IPC until released."""
        if ipc and self.core.device.type == "cuda":
            self.core.count("kv_ipc_shared")
        return self.handoffs.take(handle, ipc)

    def handoff_ready(self, handle: str) -> torch.cuda.Event | None:
        return self.handoffs.ready(handle)

    def lend_handoff(self, handle: str) -> torch.Tensor:
        return self.handoffs.lend(handle)

    def release_handoff(self, handle: str) -> None:
        self.handoffs.release(handle)

    def stats(self) -> dict[str, float]:
        core = self.core
        kv_usage = 1.0 - len(core.slots.free) / core.max_batch if self.loaded else 0.0
        prefix = {"prefix_blocks_hit": core.prefix.hits, "prefix_blocks_looked_up": core.prefix.lookups,
                  "prefix_blocks_held": len(core.prefix.index), "prefix_copies_graphed": core.prefix.copies_graphed
                  } if core.prefix is not None else {}
        graphed: dict[str, float] = {"decode_steps_graphed": core.graphs.replays} if core.graphs is not None else {}
        if core.prefill_graphs is not None:
            graphed["prefill_steps_graphed"] = core.prefill_graphs.replays
        if core.device.type == "cuda" and torch.cuda.is_initialized():
            # segments the caching allocator took from cudaMalloc (milliseconds each), so far: a first sweep that
            # grows the allocator shows here. Not memory_stats(): it flattens a few hundred figures in Python, with
            # the GIL the scheduler thread waits for (an engine process reports its stats every second)
            graphed["cuda_malloc_segments"] = torch.cuda.memory_stats_as_nested_dict(core.device)["segment"]["all"][
                "allocated"]
        return {**core.counters, **prefix, **graphed, **self.cpu_reference.stats(), "kv_usage": kv_usage,
                "handoffs_waiting": len(self.handoffs)}

    # ---- scheduler thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        """The scheduler; if it ever dies, the engine says so (health, every request) instead of hanging."""
        running: list[Seq] = []
        # which thread of the process steps the engine (its OS id): where benchmarks look for the scheduler's CPU
        self.core.counters["scheduler_thread_id"] = threading.get_native_id()
        try:
            with self.on_device():
                if self.core.device.type == "cuda":
                    prepare_pinned_copies()
                self._scheduling.set()
                self._schedule(running)
        except BaseException as exc:  # noqa: BLE001 - whatever kills the thread must be visible
            self._scheduling.set()  # dead before it was set up: the engine's start is not held for it
            log.exception("the scheduler thread died")
            self.failure = f"{type(exc).__name__}: {exc}"
            # a prompt can be in both lists if the thread died while it moved from prefill to decode
            for seq in {id(s): s for s in running + self._deferred + self._prefilling}.values():
                self.core.finish(seq, FinishReason.ERROR, error=f"engine failed: {self.failure}")
            while True:
                try:
                    seq = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if seq is not None:
                    self.core.finish(seq, FinishReason.ERROR, error=f"engine failed: {self.failure}")

    def _schedule(self, running: list[Seq]) -> None:
        """Each iteration: the arrivals admitted, the step planned (StepPlan), its prompts prefilled by the
        context steps, its rows stepped by the decode steps; the prefilled prompts stored when due."""
        clock = self.core.counters  # seconds spent idle, admitting (prefill) and decoding: /metrics, per worker
        waited = False  # the last iteration waited for work: a wait that times out goes on, not a new one
        while self._running:
            arrivals, waited = self._arrivals(running, waited)
            if arrivals is None:
                break
            t1 = time.perf_counter()
            if arrivals and not self.batch_wait.admit_now(arrivals, len(running)):
                self._deferred = arrivals  # prefilled together a few steps later
            elif arrivals:
                clock["waiting"] -= len(arrivals)
                self._admit(arrivals, running)
            plan = self._plan(running)
            stepped = False  # the decoding rows stepped with the prompts (MixedSteps)
            if plan.prefill:
                groups, decoding = plan.prefill, list(plan.decode)
                if self.mixed.takes(groups, len(decoding)):  # every prompt chunk beside the decoding rows
                    decoding, groups, stepped = self.mixed.run(groups, decoding), (), True
                running[:] = [*decoding, *self.context.run(groups)]
                self._prefilling = [s for s in self._prefilling if s.slot >= 0 and remaining(s)]
            clock["admit_seconds_total"] += time.perf_counter() - t1
            if running and not stepped:
                # the CPU's speed, read while the thread is busy: a thread just woken from a wait reads slower
                self.cpu_reference.maybe_run()
                t2 = time.perf_counter()
                if not self.decode.run(running):
                    running.clear()
                clock["decode_seconds_total"] += time.perf_counter() - t2
            if self.core.slots.unstored and self._store_due(running):
                t3 = time.perf_counter()
                self.core.slots.store(self.core.prefix)
                stored = time.perf_counter() - t3
                clock["admit_seconds_total"] += stored
                clock["store_seconds_total"] += stored
            clock["running"] = len(running)

    def _arrivals(self, running: list[Seq], waited: bool) -> tuple[list[Seq] | None, bool]:
        """The requests to admit this iteration (the batch wait's held ones first), after waiting for work when
        there is none; None once the engine closes. And whether this look waited and found nothing."""
        clock = self.core.counters
        t0 = time.perf_counter()
        # (a request already in the inbox, taken from the link by _store_due, waits for nothing)
        block = not running and not self._deferred and not self._prefilling and self._inbox.empty()
        try:
            if block and not waited:
                clock["idle_waits_total"] += 1
            intake = self.intake
            if intake is not None:  # no event loop's wake-up, and no GIL hand-off, between a request and us
                intake(INTAKE_WAIT_S if block else 0.0)
                item = self._inbox.get_nowait()
            else:
                item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            item = None
            self.handoffs.expire()
        t1 = time.perf_counter()
        clock["idle_seconds_total"] += t1 - t0
        if not block:  # no wait for work: what a busy scheduler's look at its inbox cost
            clock["idle_running_seconds_total"] += t1 - t0
        arrivals, self._deferred = self._deferred, []
        if item is not None:
            arrivals.append(item)
            while len(arrivals) < len(self.core.slots.free):  # every waiting request that fits, before decoding
                try:
                    nxt = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is not None:
                    arrivals.append(nxt)
        elif not self._running:
            return None, False
        return arrivals, block and item is None

    def _admit(self, arrivals: list[Seq], running: list[Seq]) -> None:
        """Slots for the arrivals (ContextSteps.admit): handed-over KV decodes, prompts wait for their prefill,
        the ones with no slot go back to the inbox for the next iteration, after a decode step frees slots."""
        admitted = self.context.admit(arrivals)
        running += admitted.decoding
        self._prefilling += admitted.prompts
        for seq in admitted.no_slot:
            self._inbox.put(seq)
            self.core.counters["waiting"] += 1

    def _plan(self, running: list[Seq]) -> StepPlan:
        """This iteration's work: the rows ended or cancelled since the last walk dropped (only when some did),
        the prompts' tokens that fit beside the decoding rows (ContextSteps.plan)."""
        core = self.core
        if core.leaving:
            core.leaving = 0
            running[:] = [s for s in running if core.still_running(s)]
        if not self._prefilling:
            return StepPlan(decode=tuple(running))
        self._prefilling = [s for s in self._prefilling if core.still_running(s)]
        return StepPlan(prefill=self.context.plan(self._prefilling, len(running)), decode=tuple(running))

    def _store_due(self, running: list[Seq]) -> bool:
        """Whether the prompts prefilled so far go into the prefix cache now, at the end of this iteration. An
        aggregated engine's do, after the decode step whose launch sends their first tokens. A prefill worker's
        wait until nothing does: no request waiting (the engine's link looked at again), or no free slot (the
        stored prompts' slots are held until then), or STORE_AFTER_PROMPTS of them; its arrivals then no longer
        wait behind the hashes, the pool copy and the KV events of the step before theirs."""
        if self.mode is not DisaggregationMode.PREFILL or running or self._prefilling or self._deferred:
            return True
        if len(self.core.slots.unstored) >= STORE_AFTER_PROMPTS or not self.core.slots.free:
            return True
        if self.intake is not None:
            self.intake(0.0)  # requests in the link to the worker come into the inbox
        return self._inbox.empty()

    def cancel(self, seq: Seq) -> None:
        """Drop `seq` at the scheduler's next step (from any thread). Its flag first, then the count the scheduler
        resets before it looks at the flags: a cancel the look misses leaves the count up for the next step."""
        seq.cancelled = True
        self.core.leaving += 1
