"""Upstream: tensorrt_llm/llmapi/llm.py (BaseLLM, _TorchLLM / LLM) and the PyTorch executor behind it.

Modelled, strictly:
- __init__: every kwarg must be a TorchLlmArgs field (or `backend`), else `ValueError("LLM got invalid argument:
  <key>")`; TorchLlmArgs.backend is Literal['pytorch'] (AutoDeploy has its own LLM class); nested configs refuse
  unknown fields (StrictBaseModel).
- generate_async(inputs, sampling_params, lora_request, prompt_adapter_request, streaming,
  kv_cache_retention_config, disaggregated_params, _postproc_params, scheduling_params, cache_salt):
  keyword-compatible; `context_only` forces max_tokens = 1 on the PyTorch backend; multimodal disaggregation
  (multimodal_embedding_handles) needs a text prompt and is refused for generation_only; prompts longer than
  max_num_tokens are refused when chunked prefill is off (`_check_arguments`).
- generation_only requests need the context phase's request id (disagg_request_id or ctx_request_id),
  first_gen_tokens and opaque_state, as the C++ executor's ContextPhaseParams does; the KV cache is looked up
  by that id through the cache transceiver (here: files) and a request without it fails.
- the generation-only output counts the first token (cumulative token_ids start with first_gen_tokens; max_tokens
  includes it).
- get_stats_async / get_kv_cache_events_async return IterationResult; stats exist only with
  enable_iter_perf_stats (PyExecutor), KV events only with kv_cache_config.event_buffer_max_size > 0, and the
  event buffer holds at most that many events (older ones are dropped when nobody drains it).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import pickle
import queue
import random
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from tensorrt_llm._fake_args import (CapacitySchedulerPolicy, ContextChunkingPolicy, StrictConfig, coerce,
                                     fields_of)
from tensorrt_llm.disaggregated_params import DisaggregatedParams
from tensorrt_llm.executor.result import GenerationResult, IterationResult, Response
from tensorrt_llm.llmapi.mpi_session import create_session
from tensorrt_llm.sampling_params import SamplingParams


class KvCacheConfig(StrictConfig):
    MODEL = "KvCacheConfig"


class DynamicBatchConfig(StrictConfig):
    MODEL = "DynamicBatchConfig"


class SchedulerConfig(StrictConfig):
    MODEL = "SchedulerConfig"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if "dynamic_batch_config" in kwargs:
            self.dynamic_batch_config = coerce("DynamicBatchConfig", DynamicBatchConfig, kwargs["dynamic_batch_config"])
        # enum fields by value, as pydantic validates them (a wrong value raises)
        for field, enum in (("capacity_scheduler_policy", CapacitySchedulerPolicy),
                            ("context_chunking_policy", ContextChunkingPolicy)):
            policy = kwargs.get(field)
            if policy is not None:
                setattr(self, field, enum(getattr(policy, "value", policy)))


class CacheTransceiverConfig(StrictConfig):
    MODEL = "CacheTransceiverConfig"


class MoeConfig(StrictConfig):
    MODEL = "MoeConfig"


class DecodingBaseConfig(StrictConfig):
    """upstream DecodingBaseConfig.from_dict: the config class named by decoding_type (the SpeculativeConfig union)."""

    MODEL = "DecodingBaseConfig"

    @classmethod
    def from_dict(cls, data: dict) -> StrictConfig:
        from tensorrt_llm._fake_args import table

        members = table()["speculative_decoding"]["decoding_type_values"]
        name = members.get(data.get("decoding_type"))
        if name is None:
            raise ValueError(f"Invalid decoding type: {data.get('decoding_type')}")
        return type(name, (StrictConfig,), {"MODEL": name})(**data)


_NESTED = {"kv_cache_config": KvCacheConfig, "scheduler_config": SchedulerConfig,
           "cache_transceiver_config": CacheTransceiverConfig, "moe_config": MoeConfig}


def _log(event: str, **data: Any) -> None:
    path = os.environ.get("FAKE_TRTLLM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), "ts": time.time(), **data}) + "\n")


def _transceiver_dir() -> Path:
    path = Path(os.environ.get("FAKE_TRTLLM_TRANSCEIVER_DIR")
                or Path(tempfile.gettempdir()) / f"fake-trtllm-transceiver-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def image_digest(image: Any) -> str:
    """What the fake 'vision tower' sees of an image: PIL image, or raw bytes."""
    data = image.convert("RGB").tobytes() if hasattr(image, "convert") else bytes(image)
    return hashlib.sha256(data).hexdigest()[:16]


# The token a vision model's processor expands into an image's embeddings, by config.json's model_type: the
# placeholders of tensorrt_llm/_torch/models/modeling_llava_next.py ("<image>") and modeling_qwen2vl.py /
# modeling_qwen3vl.py ("<|vision_start|><|image_pad|><|vision_end|>", of which the HF processor expands the pad).
# hpc's tiny vision model marks the image with <|image|> (hpc_vision in its config.json), written by hpc's
# frontend once per embedding (num_image_tokens), its "processor" having nothing left to expand.
IMAGE_TOKEN = {"llava_next": "<image>", "qwen2_vl": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>",
               "qwen3_vl": "<|image_pad|>", "qwen3_vl_moe": "<|image_pad|>"}


def check_image_placeholders(config: dict[str, Any], prompt: str, images: int) -> None:
    """The processor finds one placeholder per image or fails: HF's processors raise on a count that differs
    (e.g. Qwen2VLProcessor, LlavaNextProcessor), and TensorRT-LLM's fuse_input_embeds needs as many image tokens as
    embeddings (tensorrt_llm/_torch/models/modeling_multimodal_utils.py)."""
    vision = config.get("hpc_vision")
    token = "<|image|>" if vision else IMAGE_TOKEN.get(config.get("model_type", ""))
    if token is None:
        raise ValueError(f"model_type {config.get('model_type')!r} has no multimodal input processor")
    if prompt.count(token) != images * (vision["num_image_tokens"] if vision else 1):
        raise ValueError(f"the prompt has {prompt.count(token)} image placeholder(s) {token!r} for {images} "
                         f"image(s)")


# Qwen-VL's M-RoPE positions follow the image grid; under EPD they travel in DisaggregatedParams
# (mrope_position_ids_handle / mrope_position_deltas_handle, upstream tests/unittest/_torch/multimodal/
# test_mm_encoder_standalone.py) and a phase without them would place the image's tokens wrongly.
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def has_mrope(dp: Any) -> bool:
    return getattr(dp, "mrope_position_ids_handle", None) is not None and \
        getattr(dp, "mrope_position_deltas_handle", None) is not None


def tokenize(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """The input processor's tokenizer(text, add_special_tokens=...): a Llama-style tokenizer puts its BOS first
    when asked, whether or not the text already starts with one (hence upstream's add_special_tokens=False for a
    text that holds the chat template's special tokens)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return [bos] + ids if add_special_tokens and bos is not None else ids


def prompt_digest(prompt_ids: list[int]) -> str:
    return hashlib.sha256(repr(list(prompt_ids)).encode()).hexdigest()[:16]


def require_mrope(config: dict[str, Any], dp: Any, phase: str, prompt: str | None = None) -> None:
    if config.get("model_type") not in MROPE_MODEL_TYPES:
        return
    if not has_mrope(dp):
        raise ValueError(f"{config.get('model_type')}: {phase} needs mrope_position_ids_handle and "
                         "mrope_position_deltas_handle from the encoder")
    if prompt is not None and dp.mrope_position_ids_handle.get("fake_prompt") != prompt_digest(prompt):  # ids
        raise ValueError(f"{config.get('model_type')}: the encoder's M-RoPE positions were computed for another "
                         "prompt than this request's")


class BaseLLM:
    ARGS_MODEL = "TorchLlmArgs"
    BACKEND = "pytorch"
    _ids = itertools.count(1)

    def __init__(self, model: str, tokenizer: Any = None, tokenizer_mode: str = "auto",
                 skip_tokenizer_init: bool = False, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 dtype: str = "auto", revision: Optional[str] = None, tokenizer_revision: Optional[str] = None,
                 **kwargs: Any) -> None:
        backend = kwargs.get("backend", self.BACKEND)
        if backend != self.BACKEND:
            raise ValueError(f"{type(self).__name__}: backend must be {self.BACKEND!r}, got {backend!r}")
        valid = self._valid_keys() | {"backend", "_mpi_session"}
        for key in kwargs:
            if key not in valid:
                raise ValueError(f"{type(self).__name__} got invalid argument: {key}")
        for key, cls in _NESTED.items():
            if key in kwargs:
                kwargs[key] = coerce(cls.MODEL, cls, kwargs[key])
        self.args = SimpleNamespace(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, **kwargs)
        self.kwargs = kwargs
        model_dir = Path(model)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"model {model} has no config.json")
        self._config = json.loads((model_dir / "config.json").read_text())
        self._tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or model))
        session = create_session(tensor_parallel_size * int(kwargs.get("pipeline_parallel_size") or 1))
        self._executor = _Executor(self)
        self._shutdown = False
        _log("init", cls=type(self).__name__, kwargs=sorted(kwargs), tp=tensor_parallel_size,
             nested={k: type(v).__name__ for k, v in kwargs.items() if isinstance(v, (dict, StrictConfig))},
             **session)

    def _valid_keys(self) -> set[str]:
        return fields_of(self.ARGS_MODEL)

    @property
    def tokenizer(self):
        return self._tokenizer

    def generate_async(self, inputs: Any, sampling_params: Optional[SamplingParams] = None,
                       lora_request: Any = None, prompt_adapter_request: Any = None, streaming: bool = False,
                       kv_cache_retention_config: Any = None, disaggregated_params: Optional[DisaggregatedParams] = None,
                       _postproc_params: Any = None, scheduling_params: Any = None,
                       cache_salt: Optional[str] = None) -> GenerationResult:
        if self._shutdown:
            raise RuntimeError("LLM is shutting down")
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"The sampling_params must be type SamplingParams or None, got {type(sampling_params)}")
        if sampling_params.end_id is None:
            sampling_params._setup(self._tokenizer)
        dp = disaggregated_params
        if dp is not None and not isinstance(dp, DisaggregatedParams):
            raise TypeError(f"disaggregated_params must be DisaggregatedParams, got {type(dp).__name__}")
        is_ctx_only = dp is not None and dp.request_type == "context_only"
        is_gen_only = dp is not None and dp.request_type == "generation_only"
        if is_ctx_only:
            sampling_params.max_tokens = 1
        if isinstance(inputs, str):
            inputs = {"prompt": inputs}
        elif isinstance(inputs, list):
            inputs = {"prompt_token_ids": inputs}
        if not isinstance(inputs, dict):
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        digest = None
        if dp is not None and getattr(dp, "multimodal_embedding_handles", None) is not None:
            if is_gen_only:
                raise ValueError("Multimodal disaggregated inference is not supported for generation-only mode")
            if not inputs.get("prompt"):
                raise ValueError("multimodal embeddings need the text prompt (the input processor expands it)")
            digest = "+".join(h["fake_digest"] for h in dp.multimodal_embedding_handles)
            check_image_placeholders(self._config, inputs["prompt"], len(dp.multimodal_embedding_handles))
            prompt_ids = tokenize(self._tokenizer, inputs["prompt"], sampling_params.add_special_tokens)
            require_mrope(self._config, dp, "the context phase", prompt_ids)
        elif "prompt_token_ids" in inputs:
            prompt_ids = list(inputs["prompt_token_ids"])
        elif "prompt" in inputs:  # the input processor tokenizes as the request asks (inputs/registry.py)
            prompt_ids = tokenize(self._tokenizer, inputs["prompt"], sampling_params.add_special_tokens)
        else:
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        mm = inputs.get("multi_modal_data")
        if mm:
            if "image" not in mm:
                raise ValueError(f"unsupported modality in multi_modal_data: {sorted(mm)}")
            # token ids with images are decoded to text for the model's processor (llm.py, generate_async)
            text = inputs.get("prompt") or self._tokenizer.decode(prompt_ids)
            check_image_placeholders(self._config, text, len(mm["image"]))
            digest = "+".join(image_digest(img) for img in mm["image"])
        if any((not isinstance(t, int)) or t < 0 for t in prompt_ids):
            raise ValueError("prompt token ids must be non-negative integers")
        max_num_tokens = self.kwargs.get("max_num_tokens") or 8192
        if not self.kwargs.get("enable_chunked_prefill") and not is_gen_only and len(prompt_ids) > max_num_tokens:
            raise ValueError(f"The sum of prompt length ({len(prompt_ids)}) should not exceed max_num_tokens "
                             f"({max_num_tokens})")
        return self._executor.submit(prompt_ids, sampling_params, streaming, dp, digest, scheduling_params)

    def get_stats_async(self, timeout: Optional[float] = 2) -> IterationResult:
        return IterationResult(self._executor.stats, timeout)

    def get_kv_cache_events_async(self, timeout: Optional[float] = 2) -> IterationResult:
        return IterationResult(self._executor.kv_events, timeout)

    def shutdown(self) -> None:
        self._shutdown = True
        self._executor.shutdown()
        _log("shutdown")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class LLM(BaseLLM):
    """tensorrt_llm.LLM is the PyTorch-backend LLM (_TorchLLM) in 1.x."""


class _Executor:
    """The part of PyExecutor the adapter can observe: one asyncio task per request, stats and KV events."""

    TOKENS_PER_BLOCK_DEFAULT = 32

    def __init__(self, llm: BaseLLM) -> None:
        self.llm = llm
        self.vocab = int(llm._config.get("vocab_size", 4096))
        self.eos = llm._tokenizer.eos_token_id if llm._tokenizer is not None else None
        self.delay = float(os.environ.get("FAKE_TRTLLM_TOKEN_DELAY_MS", "5")) / 1000
        kv = llm.kwargs.get("kv_cache_config")
        self.block = (kv.get("tokens_per_block") if kv else None) or self.TOKENS_PER_BLOCK_DEFAULT
        self.event_buffer = (kv.get("event_buffer_max_size") if kv else 0) or 0
        self.iter_stats = bool(llm.kwargs.get("enable_iter_perf_stats"))
        self.max_batch = llm.kwargs.get("max_batch_size") or 2048
        self.stats: asyncio.Queue[str] = asyncio.Queue(maxsize=int(llm.kwargs.get("iter_stats_max_iterations") or 1000))
        self.kv_events: asyncio.Queue[str] = asyncio.Queue(maxsize=max(1, self.event_buffer))
        self.tasks: dict[int, asyncio.Task] = {}
        self.error_queue: queue.Queue = queue.Queue()
        self.aborted: set[int] = set()
        self.completed = 0
        self.transferring: set[int] = set()  # generation-only requests whose KV cache has not landed yet
        self.transfer_delay = float(os.environ.get("FAKE_TRTLLM_TRANSFER_MS", "2")) / 1000
        self.iteration = 0
        # attention-DP: one attention rank per TP rank, each with its own KV cache and event stream (upstream
        # tests/unittest/llmapi/test_llm_kv_cache_events.py: every event carries attention_dp_rank)
        tp = int(llm.args.tensor_parallel_size or 1)
        self.dp_size = tp if llm.kwargs.get("enable_attention_dp") and tp > 1 else 1
        self.rank_of: dict[int, int | None] = {}
        self.event_id = 0
        self.blocks_in_use = 0
        self.stored: list[tuple[int | None, int]] = []  # (attention-DP rank, block hash), oldest first
        self.dropped_events = 0
        self.submitted: list[SamplingParams] = []  # what each request asked for (the tests read it back)
        for rank in self._ranks():
            self._push_event({"type": "created", "num_blocks_per_cache_level": [4096, 0]}, rank)

    def _ranks(self) -> list[int | None]:
        return list(range(self.dp_size)) if self.dp_size > 1 else [None]

    def _rank(self, own_id: int, scheduling: Any) -> int | None:
        """The attention-DP rank that serves a request: the one it asks for strictly, else the engine's choice."""
        if self.dp_size == 1:
            return None
        wanted = getattr(scheduling, "attention_dp_rank", None)
        if wanted is not None and not getattr(scheduling, "attention_dp_relax", False):
            if not 0 <= wanted < self.dp_size:
                raise ValueError(f"attention_dp_rank {wanted} is not a rank of {self.dp_size}")
            return wanted
        return own_id % self.dp_size

    def submit(self, prompt: list[int], sp: SamplingParams, streaming: bool, dp: DisaggregatedParams | None,
               digest: str | None, scheduling: Any = None) -> GenerationResult:
        own_id = next(BaseLLM._ids)
        rank = self._rank(own_id, scheduling)
        self.submitted.append(sp)
        shared = getattr(dp, "disagg_request_id", None)
        request_id = shared if shared is not None else own_id
        result = GenerationResult(own_id, prompt, sp, streaming, self, disaggregated_params=dp)
        context = None
        if dp is not None and dp.request_type == "generation_only":
            try:
                context = self._receive_context(dp, prompt)
                if context.get("mrope"):  # the context ran with the encoder's positions: decode needs them too
                    require_mrope(self.llm._config, dp, "the generation phase")
            except (RuntimeError, ValueError) as exc:  # the executor answers a failed transfer with an error response
                result.aqueue.put_nowait(Response(new_token_ids=[], decoding_iter=0, is_final=True, error=str(exc)))
                return result
        trigger = os.environ.get("FAKE_TRTLLM_FAIL_FILE")
        if trigger and os.path.exists(trigger):  # the executor dies (once per file), as when an MPI rank dies
            os.unlink(trigger)
            _log("background_failure", id=own_id)
            self.fail_in_background(RuntimeError("fake: an MPI rank of the executor died"))
        self.rank_of[own_id] = rank
        _log("request", id=own_id, type=getattr(dp, "request_type", None), prompt=len(prompt), dp_rank=rank,
             max_tokens=sp.max_tokens, greedy=sp._greedy_decoding, streaming=streaming, stop=sp.stop)
        self.tasks[own_id] = asyncio.get_running_loop().create_task(
            self._run(result, request_id, prompt, sp, streaming, dp, digest, context))
        return result

    def abort_request(self, request_id: int) -> None:
        self.aborted.add(request_id)
        _log("abort", id=request_id)
        if request_id in self.transferring:
            # An abort that lands while a generation-only request's KV cache is still arriving takes the
            # executor down (Dynamo defers such aborts until the first token for this reason: ai-dynamo/dynamo
            # components/src/dynamo/trtllm/request_handlers/handler_base.py, _DeferredAbort)
            _log("abort_during_transfer", id=request_id)
            self.fail_in_background(RuntimeError("fake: a request was aborted while its KV cache was in transfer"))

    def shutdown(self) -> None:
        self.llm._shutdown = True
        for task in self.tasks.values():
            task.cancel()

    # ---- background errors (tensorrt_llm/executor/executor.py: _error_queue, _handle_background_error) -------
    def fail_in_background(self, error: Exception) -> None:
        """What a dying executor thread or MPI worker does: queue the exception for the next response."""
        self.error_queue.put(error)

    def raise_background_error(self) -> None:
        if not self.error_queue.empty():
            error = self.error_queue.get()
            self.shutdown()  # upstream shuts the executor down, then raises the exception as is
            raise error

    # ---- the cache transceiver, between processes -------------------------------------------------------
    def _send_context(self, request_id: int, prompt: list[int], digest: str | None, first: int,
                      mrope: bool = False) -> bytes:
        opaque = f"fake-comm-state:{os.getpid()}:{request_id}".encode()
        state = {"prompt": prompt, "digest": digest, "first": first, "opaque": opaque, "mrope": mrope}
        path = _transceiver_dir() / f"{request_id}.ctx"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(state))
        tmp.rename(path)
        return opaque

    def _receive_context(self, dp: DisaggregatedParams, prompt: list[int]) -> dict:
        cpp = dp.get_context_phase_params()
        if cpp.req_id is None:
            raise ValueError("generation-only request without ctx_request_id / disagg_request_id: the executor "
                             "cannot find the context phase's KV cache")
        if not cpp.first_gen_tokens:
            raise ValueError("generation-only request without first_gen_tokens")
        if cpp.opaque_state is None:
            raise ValueError("generation-only request without opaque_state (the context's comm state)")
        path = _transceiver_dir() / f"{cpp.req_id}.ctx"
        if not path.is_file():
            raise RuntimeError(f"cache transceiver: no context with request id {cpp.req_id}")
        state = pickle.loads(path.read_bytes())
        path.unlink()
        if state["opaque"] != cpp.opaque_state:
            raise RuntimeError("cache transceiver: opaque_state does not match the context's")
        if state["prompt"] != prompt:
            raise RuntimeError("cache transceiver: the prompt differs from the one the context phase ran")
        if list(cpp.first_gen_tokens) != [state["first"]]:
            raise RuntimeError("cache transceiver: first_gen_tokens differ from the context phase's")
        return state

    def _logprobs(self, token: int, k: int) -> dict:
        """A made-up distribution in upstream's shape: the sampled token at rank 1, then k - 1 others."""
        from tensorrt_llm.executor.result import Logprob

        out = {token: Logprob(logprob=-0.25, rank=1)}
        for j in range(1, k):
            out[(token + 7919 * j) % self.vocab] = Logprob(logprob=-0.25 - j, rank=j + 1)
        return out

    # ---- the 'model' ----------------------------------------------------------------------------------------
    def _next(self, seq: list[int], digest: str | None, sp: SamplingParams, step: int) -> int:
        if sp._greedy_decoding:
            h = hashlib.sha256(repr((seq[-64:], len(seq), digest)).encode()).digest()
            return 100 + int.from_bytes(h[:8], "little") % (self.vocab - 100)
        rng = random.Random(hash((sp.seed, len(seq), step))) if sp.seed is not None else random.SystemRandom()
        return rng.randrange(100, self.vocab)

    def _stopped(self, out: list[int], sp: SamplingParams) -> str | None:
        if len(out) < (sp.min_tokens or 0):  # sampling_params.py min_tokens: nothing ends the answer before
            return None
        if not sp.ignore_eos and out and out[-1] == sp.end_id:
            return "END_ID"
        for _, words in sp._get_stop_reasons_and_words():
            if words and out[-len(words):] == words:
                return "STOP_WORDS"
        return None

    async def _run(self, result: GenerationResult, request_id: int, prompt: list[int], sp: SamplingParams,
                   streaming: bool, dp: DisaggregatedParams | None, digest: str | None, context: dict | None) -> None:
        own = result.request_id
        gen_only = context is not None
        ctx_only = dp is not None and dp.request_type == "context_only"
        out: list[int] = [context["first"]] if gen_only else []
        if gen_only:
            digest = context["digest"]
        pending: list[int] = list(out)
        pending_lp: list[dict] = []
        prompt_lp = [self._logprobs(t, sp.prompt_logprobs) for t in prompt[1:]] \
            if sp.prompt_logprobs and not gen_only else []
        decoding_iter = 1 if gen_only else 0
        reason = None
        try:
            if gen_only:  # the cache transceiver brings the context's KV cache in
                self.transferring.add(own)
                try:
                    await asyncio.sleep(self.transfer_delay)
                finally:
                    self.transferring.discard(own)
            else:
                await asyncio.sleep(self.delay)  # the context phase
                self._store_blocks(prompt, self.rank_of.get(own))
            while reason is None:
                if own in self.aborted:
                    reason = "CANCELLED"
                    break
                if len(out) >= sp.max_tokens:
                    reason = "LENGTH"
                    break
                if out or gen_only:
                    await asyncio.sleep(self.delay)
                token = self._next(prompt + out, digest, sp, len(out))
                out.append(token)
                pending.append(token)
                if sp.logprobs:
                    pending_lp.append(self._logprobs(token, sp.logprobs))
                decoding_iter += 1
                self._iteration_stats(1)
                reason = self._stopped(out, sp) or ("LENGTH" if len(out) >= sp.max_tokens else None)
                if ctx_only:
                    break
                if streaming and reason is None and own not in self.aborted:
                    result.aqueue.put_nowait(Response(new_token_ids=pending, decoding_iter=decoding_iter,
                                                      new_logprobs=pending_lp, prompt_logprobs=prompt_lp))
                    pending, pending_lp, prompt_lp = [], [], []
            cpp = None
            if ctx_only:
                from tensorrt_llm.disaggregated_params import ContextPhaseParams

                opaque = self._send_context(request_id, prompt, digest, out[0], mrope=has_mrope(dp))
                cpp = ContextPhaseParams(first_gen_tokens=[out[0]], req_id=request_id, opaque_state=opaque,
                                         draft_tokens=None, ctx_dp_rank=None, ctx_info_endpoint=None)
                reason = "LENGTH"
            result.aqueue.put_nowait(Response(new_token_ids=pending, decoding_iter=decoding_iter, is_final=True,
                                              new_logprobs=pending_lp, prompt_logprobs=prompt_lp,
                                              finish_reason=reason, context_phase_params=cpp))
            _log("finish", id=own, reason=reason, tokens=len(out))
        except Exception as exc:  # noqa: BLE001 - surfaces to the caller like a background error
            result.aqueue.put_nowait(Response(new_token_ids=[], decoding_iter=decoding_iter, is_final=True,
                                              error=f"{type(exc).__name__}: {exc}"))
        finally:
            self.completed += 1
            self.tasks.pop(own, None)
            self.aborted.discard(own)
            self._evict()

    # ---- stats and KV events -------------------------------------------------------------------------------
    def _iteration_stats(self, active: int) -> None:
        self.iteration += 1
        if not self.iter_stats:
            return
        # the fields upstream's MetricsCollector.log_iteration_stats reads (tensorrt_llm/metrics/collector.py)
        stat = {"iter": self.iteration, "numActiveRequests": len(self.tasks), "maxNumActiveRequests": self.max_batch,
                "numQueuedRequests": 0, "numCompletedRequests": self.completed, "iterLatencyMS": self.delay * 1000,
                "gpuMemUsage": 1 << 30,
                "inflightBatchingStats": {"numContextRequests": 0, "numGenRequests": len(self.tasks),
                                          "numPausedRequests": 0},
                "kvCacheStats": {"usedNumBlocks": self.blocks_in_use, "maxNumBlocks": 4096,
                                 "freeNumBlocks": 4096 - self.blocks_in_use, "tokensPerBlock": self.block,
                                 "allocTotalBlocks": self.blocks_in_use, "allocNewBlocks": 0, "reusedBlocks": 0,
                                 "cacheHitRate": 0.0}}
        self.completed = 0  # completed since the last record
        if self.stats.full():
            self.stats.get_nowait()
        self.stats.put_nowait(json.dumps(stat))

    def _push_event(self, data: dict, rank: int | None = None) -> None:
        if not self.event_buffer:
            return
        self.event_id += 1
        if self.kv_events.full():  # nobody drains it: the oldest event is lost
            self.kv_events.get_nowait()
            self.dropped_events += 1
        record = {"event_id": self.event_id, "data": data, "window_size": self.block}
        if rank is not None:
            record["attention_dp_rank"] = rank
        self.kv_events.put_nowait(json.dumps(record))

    def _store_blocks(self, prompt: list[int], rank: int | None = None) -> None:
        parent = None
        blocks = []
        for start in range(0, len(prompt) - len(prompt) % self.block, self.block):
            chunk = prompt[start:start + self.block]
            h = int.from_bytes(hashlib.sha256(repr((rank, parent, chunk)).encode()).digest()[:8], "little")
            blocks.append({"type": "stored_block", "block_hash": h, "lora_id": None, "cache_level": 0,
                           "priority": 35, "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                                      for t in chunk]})
            parent = h
            self.stored.append((rank, h))
        self.blocks_in_use += len(blocks)
        if blocks:
            self._push_event({"type": "stored", "parent_hash": None, "blocks": blocks}, rank)

    def _evict(self, keep: int = 64) -> None:
        if len(self.stored) > keep:
            gone, self.stored = self.stored[:-keep], self.stored[-keep:]
            self.blocks_in_use = len(self.stored)
            for rank in self._ranks():
                hashes = [h for r, h in gone if r == rank]
                if hashes:
                    self._push_event({"type": "removed", "block_hashes": hashes}, rank)
