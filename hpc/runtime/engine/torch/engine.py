"""The torch reference engine: a KV cache in slots, iteration-level batching, streaming, cancellation.

One scheduler thread owns the model. Each iteration it admits the waiting requests that fit a slot, prefills
the prompt tokens that fit the step's max_num_tokens (together; with enable_chunked_prefill a long prompt a chunk
per iteration: context_steps), then runs one batched decode step over every running request. With tensor
parallelism, rank 0 runs the scheduler and broadcasts each step to the follower ranks, which run the same
forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import torch

from hpc.model.info import ModelInfo
from hpc.engine_args.cuda_graphs import decode_graph_sizes, prefill_graph_tokens
from hpc.engine_args.scheduling import chunking_policy, tokens_per_block
from hpc.runtime.engine.kernels import fused_decode
from hpc.runtime.engine.kv import pack as kvpack
from hpc.runtime.engine.torch.decode_graphs import DecodeGraphs
from hpc.runtime.engine.models.llama import (LlamaConfig, LlamaForCausalLM, Pipeline, TensorParallel, VisionEncoder,
                                      random_state, shard_state_dict, stage_state_dict)
from hpc.runtime.engine.models.moe import ExpertParallel, expert_state_dict
from hpc.runtime.engine.torch.outputs import Direct, Emitter
from hpc.runtime.engine.torch.picking import TokenPicker
from hpc.runtime.engine.torch.prefix_cache import PrefixCache
from hpc.runtime.engine.torch.kv_records import KvRecord
from hpc.runtime.engine.torch.prefill_graphs import PrefillGraphs
from hpc.runtime.engine.torch.context_steps import ContextSteps
from hpc.runtime.engine.torch.cpu_reference import CpuReference
from hpc.runtime.engine.torch.decode_steps import DecodeSteps
from hpc.runtime.engine.torch.warmup import WarmUp
from hpc.runtime.engine.torch.overlap import FirstTokens, HostCopies, InflightStep
from hpc.runtime.engine.torch.sequence import BatchWait, Seq, chunkable
from hpc.runtime.engine.types import (DisaggregatedParams, DisaggregationMode, EncodedMedia, EngineBase, EngineTraits,
                                      GenerateOutput, GenerateRequest, KvMeta, TokenLogprob)
from hpc.runtime.engine.torch.sampling import pick_in_graph, prepare_pinned_copies

log = logging.getLogger(__name__)
HANDOFF_TTL_S = 120.0
INTAKE_WAIT_S = 0.05  # an idle scheduler's wait for its own requests (intake): also how soon it sees close()


# decode steps a graph replay runs at most (decode_steps_a_replay; DecodeGraphs.capture takes fewer where a step
# is slow). Eight, not four: on two H200 the tiny model's disaggregated stack made 295-306k tok/s at c=64 against
# 245-268k, c=1 alike, each sweep within 6 % of the other (stack_sweeps.py, alternating; docs/performance-log.md)
DECODE_STEPS_PER_GRAPH = 8
# the LLM API's `dtype` (TensorRT-LLM llmapi/llm_args.py): "auto" is bf16 on a GPU, fp32 on the CPU
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _take_gil_switch_interval() -> None:
    """HPC_GIL_SWITCH_INTERVAL (seconds): how long a thread that wants the GIL back waits before it asks the holder
    to drop it (Python's default 5 ms). The scheduler thread gives the GIL up at each CUDA call and may then wait
    on the event loop's bursts of replies; an experiment's knob, unset by default."""
    interval = os.environ.get("HPC_GIL_SWITCH_INTERVAL")
    if interval:
        sys.setswitchinterval(float(interval))


def decode_steps_a_replay() -> int:
    """HPC_DECODE_STEPS_PER_GRAPH: decode steps one graph replay runs at most where its rows allow (DecodeGraphs'
    `steps`), DECODE_STEPS_PER_GRAPH by default; 1 is a step a replay, for comparisons."""
    steps = os.environ.get("HPC_DECODE_STEPS_PER_GRAPH", "")
    return int(steps) if steps.isdigit() and int(steps) > 0 else DECODE_STEPS_PER_GRAPH


class TorchEngine(ContextSteps, DecodeSteps, WarmUp, EngineBase):
    traits = EngineTraits(direct_stream=True, lends_kv=True, pulls_requests=True, kv_events=True)

    def __init__(self, model_dir: Path, mode: DisaggregationMode, engine_args: dict[str, Any], *,
                 device: str | None = None, tp: TensorParallel | None = None,
                 fetch_kv: Callable[[DisaggregatedParams], Any] | None = None,
                 self_address: str = "", canned_completion: str | None = None, pipeline: bool = False,
                 expert_parallel: bool = False) -> None:
        self.model_dir = Path(model_dir).expanduser()
        self.canned_completion = canned_completion
        self.mode = mode
        self.args = dict(engine_args)  # a copy: the caller's dict is never changed
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _DTYPES.get(str(self.args.get("dtype") or "auto")) or \
            (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        # `tp` is every rank of this worker (the steps are broadcast over it); with pipeline parallelism the
        # same ranks are the stages and each keeps whole layers (no tensor parallelism inside a stage).
        self.world = tp or TensorParallel()
        self.pipeline = Pipeline(self.world.rank, self.world.size, self.world.group) if pipeline else Pipeline()
        self.tp = TensorParallel() if pipeline else self.world
        # expert parallelism: the TP ranks also split the experts (EP == TP); attention stays tensor-parallel
        self.ep = ExpertParallel(self.world.rank, self.world.size, self.world.group) if expert_parallel \
            else ExpertParallel()
        self.max_batch = int(self.args.get("max_batch_size") or 32)
        self.max_len = int(self.args.get("max_seq_len") or 2048)
        # TensorRT-LLM's stream_interval: a streamed output every N tokens (the first and the last always)
        self.stream_interval = int(self.args.get("stream_interval") or 1)
        self.batch_wait = BatchWait(int(self.args.get("batch_wait_timeout_iters") or 0),
                                    float(self.args.get("batch_wait_max_tokens_ratio") or 0.0),
                                    self._token_budget())
        self._deferred: list[Seq] = []  # arrivals the batch wait holds back
        self._leaving = 0  # rows ended or cancelled since the scheduler last dropped those from its running list
        self.cpu_reference = CpuReference()  # the speed of the CPU under the scheduler thread, timed on it
        self._prefilling: list[Seq] = []  # admitted, their prompts not all in the KV cache yet
        self._unstored: dict[int, list[int]] = {}  # slot -> its prompt, prefilled, not in the prefix cache yet
        self._held_slots: list[int] = []  # released, kept from reuse until their prompts are stored
        # TensorRT-LLM's chunked prefill (hpc.engine_args.scheduling)
        self.chunking, self.chunk_unit = chunking_policy(self.args), tokens_per_block(self.args)
        if self.chunking is not None and self._token_budget() < self.chunk_unit:
            raise ValueError(f"enable_chunked_prefill: max_num_tokens ({self._token_budget()}) is below one chunk "
                             f"(kv_cache_config.tokens_per_block, {self.chunk_unit}): no long prompt could start")
        # TensorRT-LLM's overlap scheduler, on unless disable_overlap_scheduler (one rank: followers step in turn)
        self.overlap = not self.args.get("disable_overlap_scheduler") and self.world.size == 1
        self._inflight: InflightStep | None = None
        self._host_copies = HostCopies(self.max_batch, self.device)
        self._first = FirstTokens(self.max_batch, self.device)  # prefills' first tokens, still on the device
        self.fetch_kv = fetch_kv
        self.self_address = self_address
        self.cfg: LlamaConfig | None = None
        self.model: LlamaForCausalLM | None = None
        self.vision: VisionEncoder | None = None
        self.picker: TokenPicker | None = None
        self._inbox: queue.Queue = queue.Queue()
        self.handoffs = kvpack.HeldKv(HANDOFF_TTL_S)  # prefill: KV waiting for its decode worker
        self._thread: threading.Thread | None = None
        self._scheduling = threading.Event()  # the scheduler thread is set up
        self._running = False
        self.failure: str | None = None  # set when the scheduler thread dies
        self.emitter = Emitter()
        self._counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "running": 0, "waiting": 0,
                          "prompt_tokens_computed": 0, "prompt_tokens_cached": 0, "prefill_steps": 0,
                          "decode_steps": 0, "idle_seconds_total": 0.0, "admit_seconds_total": 0.0,
                          "idle_running_seconds_total": 0.0,  # of idle: the polls while rows were running
                          "idle_waits_total": 0,  # the waits for work (no rows): a closed loop's waves or gaps
                          "decode_seconds_total": 0.0, "queue_seconds_total": 0.0, "first_tokens": 0,
                          "first_token_seconds_total": 0.0, "submit_seconds_total": 0.0,
                          "inbox_seconds_total": 0.0,
                          "store_seconds_total": 0.0,  # of admit: prompts into the prefix cache
                          "finished_requests_total": 0, "finished_request_seconds_total": 0.0}
        self.on_kv_event: Callable[[dict[str, Any]], None] | None = None  # TensorRT-LLM's stored/removed records,
        # on the loop that opened the engine; or on_kv_events: a step's KvRecords at once, on the scheduler's thread
        self.on_kv_events: Callable[[list[KvRecord]], None] | None = None
        # an engine process's (engine_core): called by the scheduler at every turn with how long it may wait for a
        # request; it reads the process's requests and submits them (submit_now) on the scheduler's own thread
        self.intake: Callable[[float], None] | None = None
        self._wake_intake: Callable[[], None] | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self.prefix: PrefixCache | None = None
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    async def __aenter__(self) -> "TorchEngine":
        self._event_loop = asyncio.get_running_loop()
        _take_gil_switch_interval()
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

    def on_device(self):
        """This engine's GPU as the thread's current device: Triton launches on the current device, so a worker
        on cuda:1 would hand its kernels pointers they cannot reach (the CUDA runtime keeps one per thread)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def load(self) -> None:
        with self.on_device():
            self._load()

    def follow(self) -> None:
        """Ranks > 0: run every forward pass rank 0 broadcasts, until it says stop."""
        from hpc.runtime.engine.torch.tp import follow

        follow(self)

    def stop_followers(self) -> None:
        if self.world.size > 1:
            from hpc.runtime.engine.torch.tp import broadcast_stop

            broadcast_stop(self.world, self.device)

    def _load(self) -> None:
        from safetensors.torch import load_file

        self.cfg = LlamaConfig.load(self.model_dir)
        if self.mode in (DisaggregationMode.ENCODE, DisaggregationMode.AGGREGATED, DisaggregationMode.PREFILL) \
                and self.cfg.vision and (self.model_dir / "vision.safetensors").is_file():
            v = self.cfg.vision
            self.vision = VisionEncoder(self.cfg.hidden_size, v["image_size"], v["patch_size"])
            self.vision.load_state_dict(load_file(str(self.model_dir / "vision.safetensors")))
            self.vision.to(self.device, self.dtype).eval()
        if self.mode is DisaggregationMode.ENCODE:
            return
        if self.ep.size > 1 and not self.cfg.moe:
            raise ValueError(f"expert parallelism {self.ep.size} needs a mixture-of-experts model; "
                             f"{self.model_dir}/config.json has no num_local_experts")
        seeded = ModelInfo.read(self.model_dir).random_weights
        if seeded:  # a model of real shapes whose weights are made here, on the device (hpc model llama-8b-shape)
            with torch.device("meta"):
                model = LlamaForCausalLM(self.cfg, self.tp, self.pipeline, self.ep)
            full = random_state(self.cfg, self.device, self.dtype, int(seeded.get("seed", 0)))
        else:
            model = LlamaForCausalLM(self.cfg, self.tp, self.pipeline, self.ep)
            full = load_file(str(self.model_dir / "model.safetensors"))
        full = expert_state_dict(full, self.ep, self.cfg.num_local_experts)
        full = shard_state_dict(full, self.tp, experts_whole=self.ep.size > 1)
        model.load_state_dict(stage_state_dict(full, self.cfg, self.pipeline), assign=bool(seeded))
        self.model = model.to(self.device, self.dtype).eval().fuse_projections()
        del full, model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the unfused projections' blocks, for another worker sharing the GPU
        if fused_decode.available(self.cfg, self.device) and self.pipeline.size == 1:
            self.model.enable_fused_decode()
        log.info("torch engine on %s (%s), TP rank %d of %d, fused decode kernels: %s", self.device, self.dtype,
                 self.tp.rank, self.tp.size, "on" if self.model.fused_decode else "off")
        if self.ep.size > 1:
            own = self.ep.experts(self.cfg.num_local_experts)
            log.info("expert-parallel rank %d of %d: experts %d-%d", self.ep.rank, self.ep.size, own.start,
                     own.stop - 1)
        if self.pipeline.size > 1:
            own = self.pipeline.layers(self.cfg.num_hidden_layers)
            log.info("pipeline stage %d of %d: layers %d-%d", self.pipeline.rank, self.pipeline.size, own.start,
                     own.stop - 1)
        self.max_len = min(self.max_len, self.cfg.max_position_embeddings)
        sizes = decode_graph_sizes(self.args, self.max_batch) if self._graphable() else None
        # the decode graphs make their own copies (DecodeGraphs): a c=64 step's host time 456 -> 384 us on an H200
        # (docs/performance-log.md, session 19); HPC_DECODE_GRAPH_COPIES=0 has the host launch them, for comparisons
        copies = os.environ.get("HPC_DECODE_GRAPH_COPIES", "1") != "0"
        self.graphs = DecodeGraphs(self._decode_logits, sizes, self.max_batch, self.device, pick=pick_in_graph,
                                   copies_in_graph=copies, steps=decode_steps_a_replay()) if sizes else None
        # this rank's weights that a step multiplies by (the embeddings are looked up): a prefill step's FLOPs
        self.matmul_params = sum(p.numel() for n, p in self.model.named_parameters() if "embed_tokens" not in n)
        counts = prefill_graph_tokens(self.args, self._token_budget()) if self._graphable(prefill=True) else None
        self.prefill_graphs = PrefillGraphs(self._packed_logits, counts, self.max_batch, self.max_batch,
                                            self.max_len, self.device) if counts else None
        # one slot more with graphs: padded rows and tokens write their K/V there
        self.cache = self.model.new_cache(self.max_batch + bool(sizes or counts), self.max_len, self.dtype,
                                          self.device)
        self.free_slots = list(range(self.max_batch))
        self.picker = TokenPicker(self.model_dir, self.cfg.eos_token_id, self.max_len, self.canned_completion)
        self.prefix = self._prefix_cache()
        self.sampler = torch.Generator(device=self.device)  # unseeded requests' draws, batched on the device
        # not torch.seed(): it reseeds every GPU's default generator, other engines' in this process too
        self.sampler.manual_seed(random.getrandbits(63))
        self.warm_up()

    WARMUP_PROMPT = 16

    @torch.inference_mode()
    # ---- public API ------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
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
        `self.emitter` (generate and stream; an engine process's link sends them to its worker instead)."""
        loop = asyncio.get_running_loop()
        seq = self._seq(request, loop, outputs)
        self._check(request)
        if self.imports_kv(request):
            if self.fetch_kv is None:
                raise RuntimeError("decode engine has no KV fetcher")
            seq.imported_kv = await self.fetch_kv(request.disaggregated_params)
        return self._enqueue(seq)

    def submit_now(self, request: GenerateRequest, outputs, imported_kv: Any = None) -> Seq:
        """submit() with nothing to await, from any thread: a decode's KV already in hand (`imported_kv`). An
        engine process's scheduler thread reads its own requests and submits them this way (engine_core)."""
        seq = self._seq(request, None, outputs)
        self._check(request)
        seq.imported_kv = imported_kv
        return self._enqueue(seq)

    def _seq(self, request: GenerateRequest, loop: Any, outputs: Any) -> Seq:
        seq = Seq(request=request, emit=lambda out: self.emitter.send(loop, outputs, out), outputs=outputs)
        batchable = self.picker is not None and self.picker.batchable(request.sampling)
        if self.cfg is not None:
            seq.decode_facts(batchable, self.stream_interval, self.cfg.eos_token_id, self.cfg.vocab_size)
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
        self._counters["waiting"] += 1
        seq.queued = time.perf_counter()
        self._counters["submit_seconds_total"] += seq.queued - seq.started  # checks, the KV fetched
        self._inbox.put(seq)
        self._woken()
        return seq

    def _validate(self, request: GenerateRequest) -> None:
        if not request.token_ids:
            raise ValueError("empty prompt")
        if len(request.token_ids) + request.sampling.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(request.token_ids)} tokens) + max_tokens "
                             f"({request.sampling.max_tokens}) exceeds max_seq_len {self.max_len}")
        if self.cfg and max(request.token_ids) >= self.cfg.vocab_size:
            raise ValueError("token id outside the vocabulary")
        whole = self.chunking is None or not chunkable(request)
        imports = request.disaggregated_params is not None and self.mode is DisaggregationMode.DECODE  # no prefill
        if whole and not imports and len(request.token_ids) > self._token_budget():
            # as TensorRT-LLM's LLM API refuses it (_check_arguments): one step could never hold the prompt
            raise ValueError(f"prompt ({len(request.token_ids)} tokens) exceeds max_num_tokens "
                             f"({self._token_budget()}); set enable_chunked_prefill: true or raise max_num_tokens")
        if request.sampling.prompt_logprobs is not None and self.pipeline.size > 1:
            raise ValueError("the prompt's logprobs are not computed across pipeline stages")

    async def encode(self, pixels: torch.Tensor, prompt_token_ids: Sequence[int] = ()) -> EncodedMedia:
        """The image's embeddings (the vision tower reads no text: the prompt is not needed)."""
        if self.vision is None:
            raise RuntimeError("this model has no vision encoder")
        emb = await asyncio.to_thread(lambda: self.vision(pixels.to(self.device, self.dtype)).float().cpu())
        self._counters["requests"] += 1
        return EncodedMedia(shape=list(emb.shape), data=emb.numpy().tobytes())

    def take_handoff(self, handle: str, ipc: bool = False) -> tuple[KvMeta, bytes]:
        """The prefilled KV of `handle` (kv.HeldKv.take): as bytes, or shared over CUDA IPC until released."""
        if ipc and self.device.type == "cuda":
            self._counters["kv_ipc_shared"] = self._counters.get("kv_ipc_shared", 0) + 1
        return self.handoffs.take(handle, ipc)

    def handoff_ready(self, handle: str) -> torch.cuda.Event | None:
        return self.handoffs.ready(handle)

    def lend_handoff(self, handle: str) -> torch.Tensor:
        return self.handoffs.lend(handle)

    def release_handoff(self, handle: str) -> None:
        self.handoffs.release(handle)

    def stats(self) -> dict[str, float]:
        kv_usage = 0.0
        if self.model is not None:
            kv_usage = 1.0 - len(self.free_slots) / self.max_batch
        prefix = {"prefix_blocks_hit": self.prefix.hits, "prefix_blocks_looked_up": self.prefix.lookups,
                  "prefix_blocks_held": len(self.prefix.index), "prefix_copies_graphed": self.prefix.copies_graphed
                  } if self.prefix is not None else {}
        graphed = {"decode_steps_graphed": self.graphs.replays} if self.graphs is not None else {}
        if self.prefill_graphs is not None:
            graphed["prefill_steps_graphed"] = self.prefill_graphs.replays
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            # segments the caching allocator took from cudaMalloc (milliseconds each), so far: a first sweep that
            # grows the allocator shows here. Not memory_stats(): it flattens a few hundred figures in Python, with
            # the GIL the scheduler thread waits for (an engine process reports its stats every second)
            graphed["cuda_malloc_segments"] = torch.cuda.memory_stats_as_nested_dict(self.device)["segment"]["all"][
                "allocated"]
        return {**self._counters, **prefix, **graphed, **self.cpu_reference.stats(), "kv_usage": kv_usage,
                "handoffs_waiting": len(self.handoffs)}

    # ---- scheduler thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        """The scheduler; if it ever dies, the engine says so (health, every request) instead of hanging."""
        running: list[Seq] = []
        # which thread of the process steps the engine (its OS id): where benchmarks look for the scheduler's CPU
        self._counters["scheduler_thread_id"] = threading.get_native_id()
        try:
            with self.on_device():
                if self.device.type == "cuda":
                    prepare_pinned_copies()
                self._scheduling.set()
                self._schedule(running)
        except BaseException as exc:  # noqa: BLE001 - whatever kills the thread must be visible
            self._scheduling.set()  # dead before it was set up: the engine's start is not held for it
            log.exception("the scheduler thread died")
            self.failure = f"{type(exc).__name__}: {exc}"
            # a prompt can be in both lists if the thread died while it moved from prefill to decode
            for seq in {id(s): s for s in running + self._deferred + self._prefilling}.values():
                self._finish(seq, "error", error=f"engine failed: {self.failure}")
            while True:
                try:
                    seq = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if seq is not None:
                    self._finish(seq, "error", error=f"engine failed: {self.failure}")

    def _schedule(self, running: list[Seq]) -> None:
        clock = self._counters  # seconds spent idle, admitting (prefill) and decoding: /metrics, per worker
        waited = False  # the last iteration waited for work: a wait that times out goes on, not a new one
        while self._running:
            t0 = time.perf_counter()
            try:
                # (a request already in the inbox, taken from the link by _store_due, waits for nothing)
                block = not running and not self._deferred and not self._prefilling and self._inbox.empty()
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
            waited = block and item is None
            arrivals, self._deferred = self._deferred, []
            if item is not None:
                arrivals.append(item)
                while len(arrivals) < len(self.free_slots):  # every waiting request that fits, before decoding
                    try:
                        nxt = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is not None:
                        arrivals.append(nxt)
            elif not self._running:
                break
            if arrivals and not self.batch_wait.admit_now(arrivals, len(running)):
                self._deferred = arrivals  # prefilled together a few steps later
            elif arrivals:
                self._counters["waiting"] -= len(arrivals)
                self._admit(arrivals, running)
            if self._prefilling:
                self._context_step(running)
            clock["admit_seconds_total"] += time.perf_counter() - t1
            if self._leaving:  # a row ended or was cancelled since the last look: a pass over the rows only then
                self._leaving = 0
                running[:] = [s for s in running if self._still_running(s)]
            if running:
                # the CPU's speed, read while the thread is busy: a thread just woken from a wait reads slower
                self.cpu_reference.maybe_run()
                t2 = time.perf_counter()
                self._decode_or_fail(running)
                clock["decode_seconds_total"] += time.perf_counter() - t2
            if self._unstored and self._store_due(running):
                t3 = time.perf_counter()
                self._store_prompts()
                stored = time.perf_counter() - t3
                clock["admit_seconds_total"] += stored
                clock["store_seconds_total"] += stored
            self._counters["running"] = len(running)

    def cancel(self, seq: Seq) -> None:
        """Drop `seq` at the scheduler's next step (from any thread). Its flag first, then the count the scheduler
        resets before it looks at the flags: a cancel the look misses leaves the count up for the next step."""
        seq.cancelled = True
        self._leaving += 1

    def _still_running(self, seq: Seq) -> bool:
        if seq.cancelled and seq.slot >= 0:
            self._release(seq, walking=True)
            return False
        return seq.slot >= 0

    def _graphable(self, prefill: bool = False) -> bool:
        """Steps worth capturing: one rank (collectives stay eager), no expert routing (data-dependent token
        counts); decode: this worker decodes (a prefill worker never does) on the fused path's graph-safe
        attention; prefill: this worker prefills (a decode worker takes its KV from one)."""
        if self.device.type != "cuda" or self.world.size > 1 or self.cfg.moe:
            return False
        if prefill:
            return self.mode in (DisaggregationMode.AGGREGATED, DisaggregationMode.PREFILL)
        return self.mode is not DisaggregationMode.PREFILL and self.model.fused_decode is not None

    def _decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self._forward("decode", self.model.embed(tokens), positions, slots)

    def _packed_logits(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       prompts: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Prompts packed in one row (prefill_graphs); one rank only, so no step to broadcast."""
        return self.model.forward_step(self.model.embed(tokens[None]), positions[None], slots[None], self.cache,
                                       last=last, packed=prompts)

    def _forward(self, kind: str, embeds, positions, slots, last_only: bool = True, last=None) -> torch.Tensor:
        if self.world.size > 1:
            from hpc.runtime.engine.torch.tp import broadcast_step

            broadcast_step(self.world, kind, embeds, positions, slots)
        return self.model.forward_step(embeds, positions, slots, self.cache, last_only=last_only, last=last)

    def _emit_token(self, seq: Seq, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Send one token; False when the sequence finished with it."""
        seq.generated += 1
        seq.last_token = token
        seq.counts[token] = seq.counts.get(token, 0) + 1
        self._counters["generated_tokens"] += 1
        seq.hold(token, logprob)
        reason = self._end_of(seq, token, seq.generated)
        if reason is not None:
            self._finish(seq, reason)
            return False
        if seq.generated == 1 or seq.generated % self.stream_interval == 0:  # TensorRT-LLM's rule (_handle_responses)
            seq.send_held()
        return True

    def _end_of(self, seq: Seq, token: int, generated: int) -> str | None:
        """Why `token` ends the sequence when it is its `generated`-th: "stop" (EOS, a stop token, a complete
        guide), "length" (max_tokens, the cache's last position), or None (_emit_token, and a decode step's bare
        tokens: DecodeSteps._emit_inflight)."""
        p = seq.request.sampling
        stops = generated >= p.min_tokens and ((token == self.cfg.eos_token_id and not p.ignore_eos)
                                               or token in p.stop_token_ids)
        if stops or (seq.guide is not None and seq.guide[0].complete(seq.guide[1])):  # the guide is complete
            return "stop"
        if generated >= p.max_tokens or seq.length + 1 >= self.max_len:
            return "length"
        return None

    def _finish(self, seq: Seq, reason: str, params: DisaggregatedParams | None = None,
                error: str | None = None) -> None:
        """The last output: the tokens still held (the last one among them), why it ended."""
        seq.send_held(finished=True, finish_reason=reason, error=error, disaggregated_params=params)
        self._counters["finished_requests_total"] += 1  # and their time here, from the inbox to this last output
        self._counters["finished_request_seconds_total"] += time.perf_counter() - seq.queued
        self._release(seq)
        self._drop_pending(seq)

    @staticmethod
    def _drop_pending(seq: Seq) -> None:
        """A handed-over KV never copied (its request ended first): its owner may free it now."""
        if isinstance(seq.imported_kv, kvpack.PendingCopy):
            seq.imported_kv.drop()
            seq.imported_kv = None

    def _release(self, seq: Seq, walking: bool = False) -> None:
        """Its slot back; the scheduler walks its rows at the next step, unless this is that walk (`walking`)."""
        if seq.slot >= 0:
            # a slot whose prompt the prefix cache has yet to copy is not prefilled over before that copy
            (self._held_slots if seq.slot in self._unstored else self.free_slots).append(seq.slot)
            seq.slot = -1
            if not walking:
                self._leaving += 1
