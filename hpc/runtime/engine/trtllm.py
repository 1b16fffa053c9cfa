"""TensorRT-LLM adapter (the seeds' TensorRTLLMEngine), written against the LLM API of TensorRT-LLM >= 1.2.

TensorRT-LLM is imported lazily: everything else in hpc works without it. What the adapter relies on, and where
upstream defines it (NVIDIA/TensorRT-LLM):

- tensorrt_llm/llmapi/llm.py: `LLM(model, **llm_args)` refuses unknown kwargs; `generate_async(inputs,
  sampling_params, streaming, disaggregated_params)` returns a GenerationResult; a `context_only` request
  runs the prompt and stops after one token; `get_stats_async(timeout)` and `get_kv_cache_events_async(timeout)`
  return async iterables that end after `timeout` seconds without data, so they are drained in a loop.
- tensorrt_llm/executor/result.py: outputs hold *cumulative* token ids; the context phase's
  DisaggregatedParams (first_gen_tokens, ctx_request_id, opaque_state, draft_tokens) come back on the output; a
  generation-only output starts with the first token the context phase produced, which the frontend has
  already sent, so the decode side skips it; `abort()` cancels a request in the executor.
- tensorrt_llm/disaggregated_params.py: the generation-only request needs the context's request id (or the
  shared disagg_request_id), its first tokens and opaque state.
- tensorrt_llm/sampling_params.py `logprobs` (int): the log probabilities of that many most likely tokens plus the
  sampled one per output token (0 or None asks for none, so the adapter asks for at least 1); they come back as
  CompletionOutput.logprobs (executor/result.py), a cumulative list of {token_id: Logprob(logprob, rank)}.
- tensorrt_llm/sampling_params.py: greedy means temperature, top_p and top_k unset, or top_k == 1 (every
  release), so a request with temperature 0 goes in as top_k=1 with the others unset; `stop` strings stop
  the engine itself.
- tensorrt_llm/llmapi/mm_encoder.py: the encode worker is a MultimodalEncoder; its result's
  disaggregated_params.multimodal_embedding_handles go to the prefill (context_only) request.
- tensorrt_llm/_torch/auto_deploy/llm.py: AutoDeploy has its own LLM class.
- tensorrt_llm/executor/executor.py (`_handle_background_error`) and executor/utils.py (`RequestError`): a
  response's error message is a per-request error raised as RequestError, and the executor keeps serving; an
  exception from a background thread or MPI worker shuts the executor down and is raised as is from whichever
  result is read next; a shut-down LLM refuses generate_async with RuntimeError. The adapter keeps the first
  two apart: a RequestError fails one request, anything else marks the engine failed (`failure`), which fails
  every request it holds and the worker's health, and the role's failure policy restarts it.

The engine arguments arrive final (hpc/engine_args/precedence.py builds them into the manifest); this module
only turns nested dicts into the LLM API's config classes.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import io
import logging
import secrets
from pathlib import Path
from typing import Any, AsyncGenerator, Callable, Sequence

from hpc.model.info import ModelInfo
from hpc.model.placeholders import encoder_prompt
from hpc.runtime.engine.types import (DisaggregatedParams, DisaggregationMode, EncodedMedia, EngineBase, EngineTraits,
                                      FinishReason, GenerateOutput, GenerateRequest, KvMeta, SamplingParams,
                                      TokenLogprob, TrtllmContextParams)

log = logging.getLogger(__name__)

# How long one drain call of stats / KV events waits for data before it is called again.
DRAIN_TIMEOUT_S = 2.0
STATS_KEYS = ("numActiveRequests", "maxNumActiveRequests", "numQueuedRequests")
# Global disaggregated request ids live in [2^40, 2^63), apart from the executor's local ids [0, 2^40)
# (tensorrt_llm/llmapi/disagg_utils.py, MIN_GLOBAL_ID): one drawn below 2^40 could collide with a local one.
MIN_GLOBAL_ID = 1 << 40
# How long a decode whose client left waits for its KV cache to land before it is aborted anyway: an abort
# mid-transfer can take the executor down (Dynamo defers it: request_handlers/handler_base.py, _DeferredAbort).
ABORT_AFTER_TRANSFER_S = 60.0
MROPE_FIELDS = ("mrope_position_ids_handle", "mrope_position_deltas_handle")
# MultimodalEncoder's arguments (tensorrt_llm/llmapi/mm_encoder.py takes trust_remote_code by name)
ENCODER_ARGS = ("max_batch_size", "trust_remote_code")


# TensorRT-LLM's own metrics from its iteration stats, named as its MetricsCollector names them
# (tensorrt_llm/metrics/collector.py, log_iteration_stats): (metric, where in the record, scale)
ITERATION_GAUGES = (
    ("trtllm_num_requests_running", ("numActiveRequests",), 1.0),
    ("trtllm_num_requests_waiting", ("numQueuedRequests",), 1.0),
    ("trtllm_max_num_active_requests", ("maxNumActiveRequests",), 1.0),
    ("trtllm_iteration_latency_seconds", ("iterLatencyMS",), 1e-3),
    ("trtllm_gpu_memory_usage_bytes", ("gpuMemUsage",), 1.0),
    ("trtllm_kv_cache_hit_rate", ("kvCacheStats", "cacheHitRate"), 1.0),
    ("trtllm_kv_cache_max_blocks", ("kvCacheStats", "maxNumBlocks"), 1.0),
    ("trtllm_kv_cache_free_blocks", ("kvCacheStats", "freeNumBlocks"), 1.0),
    ("trtllm_kv_cache_used_blocks", ("kvCacheStats", "usedNumBlocks"), 1.0),
    ("trtllm_kv_cache_tokens_per_block", ("kvCacheStats", "tokensPerBlock"), 1.0),
    ("trtllm_num_context_requests", ("inflightBatchingStats", "numContextRequests"), 1.0),
    ("trtllm_num_generation_requests", ("inflightBatchingStats", "numGenRequests"), 1.0),
    ("trtllm_num_paused_requests", ("inflightBatchingStats", "numPausedRequests"), 1.0),
)
# per-iteration counts, summed into totals (the collector's counters)
ITERATION_COUNTERS = (
    ("trtllm_num_requests_completed_total", ("numCompletedRequests",)),
    ("trtllm_spec_decode_num_draft_tokens_total", ("specDecodingStats", "numDraftTokens")),
    ("trtllm_spec_decode_num_accepted_tokens_total", ("specDecodingStats", "numAcceptedTokens")),
)


def _field(record: dict, path: tuple[str, ...]) -> Any:
    value: Any = record
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def trtllm_metrics(stat: dict, before: dict[str, float]) -> dict[str, float]:
    """One iteration-stats record as TensorRT-LLM's metrics: gauges as they are now, counters summed onto
    `before`'s totals; a field the version does not report is left out."""
    out = {}
    for name, path, scale in ITERATION_GAUGES:
        value = _field(stat, path)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value) * scale
    used, most = _field(stat, ("kvCacheStats", "usedNumBlocks")), _field(stat, ("kvCacheStats", "maxNumBlocks"))
    if isinstance(used, (int, float)) and isinstance(most, (int, float)) and most:
        out["trtllm_kv_cache_utilization"] = used / most
    for name, path in ITERATION_COUNTERS:
        value = _field(stat, path)
        out[name] = before.get(name, 0.0) + (float(value) if isinstance(value, (int, float)) and value > 0 else 0.0)
    return out


def global_disagg_request_id() -> int:
    return MIN_GLOBAL_ID + secrets.randbelow((1 << 63) - MIN_GLOBAL_ID)


def disagg_params(cls: Any, **values: Any) -> Any:
    """DisaggregatedParams with the fields the image's TensorRT-LLM has (a keyword-only slots dataclass: a field
    it lacks is a TypeError). Optional extras it lacks are left out (disagg_request_id: the decode side then names
    the context by ctx_request_id); a value the request cannot do without is a per-request error naming it."""
    have = {f.name for f in dataclasses.fields(cls)}
    needed = [k for k in ("multimodal_embedding_handles", *MROPE_FIELDS) if values.get(k) is not None and k not in have]
    if needed:
        from tensorrt_llm import __version__ as version

        raise ValueError(f"TensorRT-LLM {version} has no DisaggregatedParams.{needed[0]}: this request cannot be "
                         "handed between workers on it (hpc validate names the versions that can)")
    return cls(**{k: v for k, v in values.items() if k in have and v is not None})


def import_trtllm():
    try:
        import tensorrt_llm
        from tensorrt_llm import llmapi
    except ImportError as exc:
        raise RuntimeError(
            "TensorRT-LLM is not installed in this environment (pip cannot install it here). Use a container "
            "with TensorRT-LLM (a cluster profile with container.image), or run the recipe with the torch "
            f"reference engine: --set backend=torch ({exc})") from None
    return tensorrt_llm, llmapi


# Nested engine arguments the LLM API takes as its own config classes, converted from a YAML's dicts as upstream
# converts them before LLM(...) sees them (tensorrt_llm/llmapi/llm_args.py, update_llm_args_with_extra_dict:
# "some fields need to be converted manually"; Dynamo's update_llm_args_with_extra_options does the same). A class
# the image's llmapi does not export stays a dict, as that version's own code would leave it.
NESTED_CONFIGS = {"kv_cache_config": "KvCacheConfig", "cache_transceiver_config": "CacheTransceiverConfig",
                  "moe_config": "MoeConfig", "lora_config": "LoraConfig", "peft_cache_config": "PeftCacheConfig",
                  "quant_config": "QuantConfig", "calib_config": "CalibConfig",
                  "extended_runtime_perf_knob_config": "ExtendedRuntimePerfKnobConfig"}


def _speculative(config: dict[str, Any], llmapi: Any) -> Any:
    """speculative_config by its decoding_type, as upstream's DecodingBaseConfig.from_dict picks the class."""
    decoding = getattr(llmapi, "DecodingBaseConfig", None)
    return config if decoding is None else decoding.from_dict(config)


def llm_kwargs(args: dict[str, Any], llmapi: Any) -> dict[str, Any]:
    """The manifest's engine args as LLM(...) keyword arguments: nested dicts become the API's config classes."""
    kwargs = copy.deepcopy(args)
    for field, name in NESTED_CONFIGS.items():
        cls = getattr(llmapi, name, None)
        if isinstance(kwargs.get(field), dict) and cls is not None:
            kwargs[field] = cls(**kwargs[field])
    if isinstance(kwargs.get("speculative_config"), dict):
        kwargs["speculative_config"] = _speculative(kwargs["speculative_config"], llmapi)
    scheduler = kwargs.get("scheduler_config")
    if isinstance(scheduler, dict):
        scheduler = dict(scheduler)
        if isinstance(scheduler.get("dynamic_batch_config"), dict):
            scheduler["dynamic_batch_config"] = llmapi.DynamicBatchConfig(**scheduler["dynamic_batch_config"])
        for field, enum in (("capacity_scheduler_policy", "CapacitySchedulerPolicy"),
                            ("context_chunking_policy", "ContextChunkingPolicy")):
            if isinstance(scheduler.get(field), str):
                scheduler[field] = getattr(llmapi, enum)(scheduler[field])
        kwargs["scheduler_config"] = llmapi.SchedulerConfig(**scheduler)
    return kwargs


def engine_class(tensorrt_llm: Any, llmapi: Any, mode: DisaggregationMode, backend: str) -> Callable[..., Any]:
    if mode is DisaggregationMode.ENCODE:
        return llmapi.MultimodalEncoder
    if backend == "_autodeploy":
        from tensorrt_llm._torch.auto_deploy.llm import LLM as AutoDeployLLM

        return AutoDeployLLM
    return tensorrt_llm.LLM


def trtllm_guide(guide: Any, guided_cls: Any) -> Any:
    """hpc's Guide as GuidedDecodingParams: a lone JSON object is `json_object`, anything else an EBNF `grammar`
    (tensorrt_llm/sampling_params.py; the LLM's guided_decoding_backend, xgrammar or llguidance, compiles it)."""
    from hpc.runtime.engine.guided import to_ebnf

    if [p.kind for p in guide.pieces] == ["json_object"]:
        return guided_cls(json_object=True)
    return guided_cls(grammar=to_ebnf(guide))


def trtllm_sampling(s: SamplingParams, sampling_cls: Any, guided_cls: Any = None) -> Any:
    greedy = s.temperature == 0.0
    return sampling_cls(
        guided_decoding=trtllm_guide(s.guide, guided_cls) if s.guide is not None else None,
        max_tokens=s.max_tokens,
        temperature=None if greedy else s.temperature,
        top_p=None if greedy or s.top_p >= 1.0 else s.top_p,
        top_k=1 if greedy else (s.top_k or None),
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos, min_tokens=s.min_tokens or None,
        logprobs=None if s.logprobs is None else max(1, s.logprobs),
        prompt_logprobs=None if s.prompt_logprobs is None else max(1, s.prompt_logprobs),
        presence_penalty=s.presence_penalty or None, frequency_penalty=s.frequency_penalty or None,
        repetition_penalty=None if s.repetition_penalty == 1.0 else s.repetition_penalty,
        detokenize=False)  # the frontend detokenizes (as Dynamo's worker: the engine would do it twice)


def finish_reason(upstream: str | None) -> FinishReason:
    """CompletionOutput.finish_reason (executor/result.py: 'stop' | 'length' | 'timeout' | 'cancelled'); a
    finished output without one (or of a reason a later release adds) stopped."""
    try:
        return FinishReason(upstream)
    except ValueError:
        return FinishReason.STOP


def token_logprobs(new: list[int], cumulative: list[dict], top: int) -> list[TokenLogprob]:
    """The new tokens' entries of CompletionOutput.logprobs, as hpc's TokenLogprob. Aligned from the end: a
    generation-only output has no entry for the first token (the context phase produced it)."""
    entries = cumulative[len(cumulative) - len(new):] if len(cumulative) >= len(new) else []
    out = []
    for token, entry in zip(new, entries):
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 1 << 30, -kv[1].logprob))[:top]
        chosen = entry.get(token)
        out.append(TokenLogprob(token_id=token, logprob=chosen.logprob if chosen else float("-inf"),
                                top_ids=[t for t, _ in ranked], top_logprobs=[lp.logprob for _, lp in ranked]))
    return out


class TrtllmEngine(EngineBase):
    traits = EngineTraits(own_image_loader=True, kv_events=True)

    def __init__(self, model_dir: str, mode: DisaggregationMode, engine_args: dict[str, Any],
                 self_address: str = "", load_image_bytes: Callable[[str], bytes] | None = None) -> None:
        self.model_dir = str(Path(model_dir).expanduser())
        self.mode = mode
        self.args = copy.deepcopy(engine_args)  # never change the caller's dict
        self.backend = self.args.pop("backend", "pytorch")  # AutoDeploy's LLM class sets it itself
        self.self_address = self_address
        self.load_image_bytes = load_image_bytes
        self._llm: Any = None  # tensorrt_llm.LLM, once loaded (imported lazily: not installed here)
        self._drains: list[asyncio.Task] = []
        self.on_kv_event: Callable[[dict], None] | None = None
        self.on_stats: Callable[[dict], None] | None = None
        self._engine_stats: dict[str, float] = {}
        self.failure: str | None = None  # set when the executor died; the worker watches it
        self._failed: asyncio.Future[None] | None = None
        self._counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "running": 0,
                          "aborted": 0, "aborts_deferred": 0, "kv_events": 0, "stats_records": 0}
        self._deferred: set[asyncio.Future] = set()  # aborts waiting for their KV transfer to land

    async def __aenter__(self) -> "TrtllmEngine":
        tensorrt_llm, llmapi = import_trtllm()
        self._api = (tensorrt_llm, llmapi)
        from tensorrt_llm.executor.utils import RequestError

        self._request_error = RequestError
        self._failed = asyncio.get_running_loop().create_future()
        cls = engine_class(tensorrt_llm, llmapi, self.mode, self.backend)
        if self.mode is DisaggregationMode.ENCODE:
            # The vision encoder takes what Dynamo's encode worker gives it (encode_helper.py: the model and its
            # batch), not the language model's scheduler, KV cache, events or stats settings.
            kwargs = {k: self.args[k] for k in ENCODER_ARGS if k in self.args}
        else:
            kwargs = llm_kwargs(self.args, llmapi)
        if self.backend != "_autodeploy" and self.mode is not DisaggregationMode.ENCODE:
            kwargs["backend"] = self.backend
        log.info("building %s for %s from %s", cls.__name__, self.mode.value, self.model_dir)
        self._llm = await asyncio.to_thread(lambda: cls(model=self.model_dir, **kwargs))
        if self.mode is DisaggregationMode.ENCODE:  # what encode() sends beside each image
            self._encoder_prompt = encoder_prompt(dict(ModelInfo.read(self.model_dir).config))
        else:
            self._drains = [asyncio.create_task(self._drain(self._llm.get_stats_async, self._stat)),
                            asyncio.create_task(self._drain(self._llm.get_kv_cache_events_async, self._kv_event))]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for task in self._drains:
            task.cancel()
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)

    def attention_dp_size(self) -> int:
        return int(self.args.get("tensor_parallel_size", 1)) if self.args.get("enable_attention_dp") else 1

    # ---- stats and KV events --------------------------------------------------------------------------------
    async def _drain(self, source: Callable[..., Any], sink: Callable[[dict], None]) -> None:
        """Keep the engine's bounded buffers empty: a call yields what arrived, then ends after a quiet timeout."""
        while True:
            try:
                async for item in source(timeout=DRAIN_TIMEOUT_S):
                    sink(item)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failed drain must never take serving down
                log.warning("draining %s failed: %s", getattr(source, "__name__", source), exc)
                await asyncio.sleep(DRAIN_TIMEOUT_S)
            await asyncio.sleep(0)

    def _stat(self, stat: dict) -> None:
        self._counters["stats_records"] += 1
        kv = stat.get("kvCacheStats") or {}
        self._engine_stats = {**{k: float(stat.get(k, 0)) for k in STATS_KEYS},
                              "kv_used_blocks": float(kv.get("usedNumBlocks", 0)),
                              "kv_max_blocks": float(kv.get("maxNumBlocks", 0)),
                              **trtllm_metrics(stat, self._engine_stats)}
        if self.on_stats is not None:
            self.on_stats(stat)

    def _kv_event(self, event: dict) -> None:
        self._counters["kv_events"] += 1
        if self.on_kv_event is not None:
            self.on_kv_event(event)

    # ---- requests ---------------------------------------------------------------------------------------------
    def _image(self, ref: str) -> Any:
        if self.load_image_bytes is None:
            raise ValueError("this worker takes no images")
        return self.load_image(self.load_image_bytes(ref))

    @staticmethod
    def load_image(data: bytes) -> Any:
        """Image bytes -> the PIL image TensorRT-LLM's multimodal input processors take."""
        from PIL import Image, UnidentifiedImageError

        try:
            return Image.open(io.BytesIO(data)).convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"not a readable image: {exc}") from None

    async def _inputs(self, request: GenerateRequest) -> tuple[Any, Any, int]:
        """(inputs, DisaggregatedParams or None, tokens of the output the frontend already has)."""
        _, llmapi = self._api
        Disagg = llmapi.DisaggregatedParams
        if self.mode is DisaggregationMode.DECODE or request.disaggregated_params is not None:
            p = request.disaggregated_params
            if p is None or p.trtllm is None:
                raise ValueError("a TensorRT-LLM decode request needs the context phase's parameters")
            t = p.trtllm
            dp = disagg_params(Disagg, request_type="generation_only", first_gen_tokens=list(t.first_gen_tokens),
                               ctx_request_id=t.ctx_request_id, disagg_request_id=t.disagg_request_id,
                               opaque_state=t.opaque_state, draft_tokens=t.draft_tokens, ctx_dp_rank=t.ctx_dp_rank,
                               ctx_info_endpoint=t.ctx_info_endpoint,
                               mrope_position_ids_handle=t.mrope_position_ids_handle,
                               mrope_position_deltas_handle=t.mrope_position_deltas_handle)
            return list(t.prompt_token_ids), dp, len(t.first_gen_tokens)
        media = request.media if request.media is not None and request.media.handles else None
        request_type = "context_only" if self.mode is DisaggregationMode.PREFILL else \
            "context_and_generation" if media is not None else None
        dp = None
        if request_type is not None:
            # One global id for both sides, so the decode engine finds this context whichever prefill worker ran
            # it (a version without disagg_request_id names it by ctx_request_id, which the output carries).
            dp = disagg_params(
                Disagg, request_type=request_type,
                disagg_request_id=global_disagg_request_id() if self.mode is DisaggregationMode.PREFILL else None,
                multimodal_embedding_handles=media.handles if media else None,
                multimodal_hashes=media.hashes if media else None,
                mrope_position_ids_handle=media.mrope_position_ids_handle if media else None,
                mrope_position_deltas_handle=media.mrope_position_deltas_handle if media else None)
        inputs: Any = list(request.token_ids)
        if media is not None:
            # The model's input processor expands the image placeholder in the text prompt itself.
            inputs = {"prompt": self._llm.tokenizer.decode(request.token_ids)}
        elif request.image:
            image = await asyncio.to_thread(self._image, request.image)
            # As text: the model's processor expands the image placeholder in the prompt's text. TensorRT-LLM
            # decodes token ids with an image itself in recent versions (llm.py, generate_async); older ones take
            # the token ids as they are and leave the image out.
            inputs = {"prompt": self._llm.tokenizer.decode(request.token_ids), "multi_modal_data": {"image": [image]}}
        return inputs, dp, 0

    # ---- executor faults ------------------------------------------------------------------------------------
    def _fault(self, exc: Exception) -> Exception:
        """The exception a caller sees: a per-request error as it is; anything else fails the whole engine."""
        if isinstance(exc, (self._request_error, ValueError, TypeError)):
            return exc
        if self.failure is None:
            self.failure = f"{type(exc).__name__}: {exc}"
            log.error("TensorRT-LLM's executor failed: %s", self.failure)
            if self._failed is not None and not self._failed.done():
                self._failed.set_result(None)
        return RuntimeError(f"engine failed: {self.failure}")

    async def _until_failure(self, result: Any) -> AsyncGenerator[Any, None]:
        """The result's outputs; when the engine fails meanwhile (another request read the background error,
        and the executor that would answer this one is gone), this request fails at once instead of waiting."""
        outputs = result.__aiter__()
        while True:
            step = asyncio.ensure_future(outputs.__anext__())
            await asyncio.wait([step] if self._failed is None else [step, self._failed],
                               return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                raise RuntimeError(f"engine failed: {self.failure}")
            try:
                out = step.result()
            except StopAsyncIteration:
                return
            except Exception as exc:
                raise self._fault(exc) from exc
            yield out

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        if self.failure:
            raise RuntimeError(f"engine failed: {self.failure}")
        tensorrt_llm, _ = self._api
        if request.sampling.guide is not None and not self.args.get("guided_decoding_backend"):
            raise ValueError("constrained output (response_format json_object, a forced tool call) needs the "
                             "role's engine config to set guided_decoding_backend: xgrammar (or llguidance)")
        inputs, dp, cursor = await self._inputs(request)
        from tensorrt_llm.sampling_params import GuidedDecodingParams

        params = trtllm_sampling(request.sampling, tensorrt_llm.SamplingParams, GuidedDecodingParams)
        if isinstance(inputs, dict) and "prompt" in inputs:
            # the text holds the chat template's special tokens already: a second BOS would change the prompt
            params.add_special_tokens = False
        streaming = request.streaming and self.mode is not DisaggregationMode.PREFILL
        scheduling = None
        if request.dp_rank is not None and self.attention_dp_size() > 1:
            # the attention-DP rank whose KV cache holds the prefix (the router's pick), strictly: as Dynamo
            # passes its router's dp_rank (request_handlers/handler_base.py)
            from tensorrt_llm.scheduling_params import SchedulingParams

            scheduling = SchedulingParams(attention_dp_rank=request.dp_rank, attention_dp_relax=False)
        try:
            result = self._llm.generate_async(inputs, sampling_params=params, streaming=streaming,
                                              disaggregated_params=dp, scheduling_params=scheduling)
        except Exception as exc:
            raise self._fault(exc) from exc
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += len(request.token_ids)
        self._counters["running"] += 1
        sent_prompt_lp = landed = False
        try:
            async for out in self._until_failure(result):
                landed = True
                completion = out.outputs[0]
                new = list(completion.token_ids[cursor:])
                cursor = len(completion.token_ids)
                self._counters["generated_tokens"] += len(new)
                handoff = None
                if self.mode is DisaggregationMode.PREFILL and out.finished:
                    handoff = self._handoff(request, out, completion.disaggregated_params, dp)
                logprobs = prompt_lp = None
                if request.sampling.logprobs is not None:
                    logprobs = token_logprobs(new, completion.logprobs or [], request.sampling.logprobs)
                if request.sampling.prompt_logprobs is not None and not sent_prompt_lp \
                        and completion.prompt_logprobs:  # CompletionOutput.prompt_logprobs, once
                    prompt_lp = token_logprobs(request.token_ids[1:], completion.prompt_logprobs,
                                               request.sampling.prompt_logprobs)
                    sent_prompt_lp = True
                yield GenerateOutput(token_ids=new, finished=out.finished,
                                     finish_reason=finish_reason(completion.finish_reason) if out.finished else None,
                                     prompt_tokens=len(request.token_ids), disaggregated_params=handoff,
                                     logprobs=logprobs, prompt_logprobs=prompt_lp)
        finally:
            self._counters["running"] -= 1
            if not result.finished and not self.failure:
                # The client left, the deadline passed, or the caller stopped reading: free the engine's slot. A
                # generation-only request whose KV cache is still arriving is aborted once it has landed.
                self._counters["aborted"] += 1
                if landed or dp is None or dp.request_type != "generation_only":
                    result.abort()
                else:
                    self._counters["aborts_deferred"] += 1
                    task = asyncio.ensure_future(self._abort_after_transfer(result))
                    self._deferred.add(task)
                    task.add_done_callback(self._deferred.discard)

    async def _abort_after_transfer(self, result: Any) -> None:
        try:
            await asyncio.wait_for(result.__anext__(), ABORT_AFTER_TRANSFER_S)  # the first output: it has landed
        except Exception:  # noqa: BLE001 - finished, failed or timed out: abort what is left all the same
            pass
        if not result.finished and not self.failure:
            result.abort()

    def _handoff(self, request: GenerateRequest, out: Any, ctx: Any, sent: Any) -> DisaggregatedParams:
        if ctx is None or not ctx.first_gen_tokens:
            raise RuntimeError("the context phase returned no disaggregated params")
        extra = {k: getattr(ctx, k, None) or getattr(sent, k, None)  # fields a version may not have
                 for k in ("disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint", *MROPE_FIELDS)}
        t = TrtllmContextParams(
            first_gen_tokens=list(ctx.first_gen_tokens), ctx_request_id=ctx.ctx_request_id,
            opaque_state=ctx.opaque_state or None, draft_tokens=ctx.draft_tokens,
            prompt_token_ids=list(out.prompt_token_ids or request.token_ids), **extra)
        return DisaggregatedParams(request_handle="trtllm", prefill_address=self.self_address,
                                   first_token_id=t.first_gen_tokens[0], prompt_length=len(t.prompt_token_ids),
                                   trtllm=t)

    async def encode(self, image: Any, prompt_token_ids: Sequence[int] = ()) -> EncodedMedia:
        """One image (a PIL image from load_image) -> TensorRT-LLM's multimodal embedding handles. The input
        processor runs on the request's own prompt where it came along (Qwen-VL's M-RoPE positions span the whole
        prompt), else on the model's placeholder alone."""
        inputs = {"prompt": self._encoder_prompt, "multi_modal_data": {"image": [image]}}
        params = None
        if prompt_token_ids:
            tensorrt_llm, _ = self._api
            inputs["prompt"] = self._llm.tokenizer.decode(list(prompt_token_ids))
            # the text holds the template's special tokens already, as the prefill request's does (no second BOS)
            params = tensorrt_llm.SamplingParams(add_special_tokens=False)
        result = self._llm.generate_async(inputs, sampling_params=params)
        await result.aresult()
        dp = result.disaggregated_params
        handles = getattr(dp, "multimodal_embedding_handles", None)
        if not handles:
            raise RuntimeError("the multimodal encoder returned no embedding handles")
        self._counters["requests"] += 1
        mrope: dict[str, Any] = {k: getattr(dp, k, None) for k in MROPE_FIELDS}  # Qwen-VL's positions, on to prefill
        return EncodedMedia(shape=list(handles[0].get("tensor_size", [])), handles=handles,
                            hashes=getattr(dp, "multimodal_hashes", None), **mrope)

    def take_handoff(self, handle: str, ipc: bool = False) -> tuple[KvMeta, bytes | memoryview]:
        raise RuntimeError("with TensorRT-LLM the cache transceiver moves the KV cache, not hpc")

    def stats(self) -> dict[str, float]:
        return {**self._counters, **self._engine_stats}
