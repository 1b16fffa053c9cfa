"""TensorRT-LLM adapter (the seeds' TensorRTLLMEngine), written against the documented LLM API.

TensorRT-LLM is imported lazily: everything else in hpc works without it. Disaggregation follows the
LLM API: a prefill request is `context_only` and returns DisaggregatedParams (opaque KV state + first
token); the decode request is `generation_only` with those params, and the cache transceiver moves
the KV cache between the two engines.
"""

from __future__ import annotations

import base64
import copy
import logging
from pathlib import Path
from typing import Any, AsyncIterator

from hpc.engine_args.precedence import prune_for_autodeploy
from hpc.runtime.engine.types import (DisaggregatedParams, DisaggregationMode, EncodedMedia, GenerateOutput,
                                      GenerateRequest)

log = logging.getLogger(__name__)


def import_trtllm():
    try:
        import tensorrt_llm  # noqa: F401
        from tensorrt_llm import llmapi
    except ImportError as exc:
        raise RuntimeError(
            "TensorRT-LLM is not installed in this environment (pip cannot install it here). Use a container "
            "with TensorRT-LLM (cluster profile 'container'), or run the recipe with the torch reference engine: "
            f"--set backend=torch ({exc})") from None
    return tensorrt_llm, llmapi


class TrtllmEngine:
    def __init__(self, model_dir: str, mode: DisaggregationMode, engine_args: dict[str, Any],
                 self_address: str = "") -> None:
        self.model_dir = str(Path(model_dir).expanduser())
        self.mode = mode
        self.args = copy.deepcopy(engine_args)  # never change the caller's dict
        self.self_address = self_address
        self._llm = None
        self._counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "running": 0, "waiting": 0}

    def _build_kwargs(self, llmapi) -> dict[str, Any]:
        args = copy.deepcopy(self.args)
        backend = args.pop("backend", "pytorch")
        if backend == "_autodeploy":
            args = prune_for_autodeploy(args)
        kv = args.pop("kv_cache_config", {}) or {}
        args["kv_cache_config"] = llmapi.KvCacheConfig(**kv)
        scheduler = args.pop("scheduler_config", {}) or {}
        dyn = scheduler.pop("dynamic_batch_config", None)
        scheduler.setdefault("capacity_scheduler_policy", llmapi.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
        if dyn:
            scheduler["dynamic_batch_config"] = llmapi.DynamicBatchConfig(**dyn)
        args["scheduler_config"] = llmapi.SchedulerConfig(**scheduler)
        args["backend"] = backend
        return args

    async def __aenter__(self) -> "TrtllmEngine":
        tensorrt_llm, llmapi = import_trtllm()
        kwargs = self._build_kwargs(llmapi)
        if self.mode is DisaggregationMode.ENCODE:
            from tensorrt_llm.llmapi import MultimodalEncoder

            keep = {"tensor_parallel_size", "max_batch_size", "max_num_tokens", "trust_remote_code"}
            self._llm = MultimodalEncoder(model=self.model_dir, **{k: v for k, v in kwargs.items() if k in keep})
        else:
            self._llm = tensorrt_llm.LLM(model=self.model_dir, **kwargs)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._llm is not None:
            self._llm.shutdown()

    def attention_dp_size(self) -> int:
        return int(self.args.get("tensor_parallel_size", 1)) if self.args.get("enable_attention_dp") else 1

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        from tensorrt_llm import SamplingParams
        from tensorrt_llm.llmapi import DisaggregatedParams as TrtDisagg

        s = request.sampling
        params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature or None, top_p=s.top_p,
                                top_k=s.top_k or None, seed=s.seed, stop_token_ids=s.stop_token_ids or None,
                                ignore_eos=s.ignore_eos)
        disagg = None
        if self.mode is DisaggregationMode.PREFILL:
            disagg = TrtDisagg(request_type="context_only")
            params.max_tokens = 1
        elif request.disaggregated_params is not None:
            p = request.disaggregated_params
            state = base64.b64decode(p.request_handle) if p.request_handle else None
            disagg = TrtDisagg(request_type="generation_only", first_gen_tokens=[p.first_token_id],
                               opaque_state=state)
        self._counters["requests"] += 1
        sent = 0
        async for out in self._llm.generate_async(request.token_ids, sampling_params=params,
                                                  streaming=request.streaming, disaggregated_params=disagg):
            completion = out.outputs[0]
            new = list(completion.token_ids[sent:])
            sent = len(completion.token_ids)
            self._counters["generated_tokens"] += len(new)
            handoff = None
            if self.mode is DisaggregationMode.PREFILL and out.finished:
                dp = completion.disaggregated_params
                handoff = DisaggregatedParams(
                    request_handle=base64.b64encode(dp.opaque_state or b"").decode(),
                    prefill_address=self.self_address, first_token_id=dp.first_gen_tokens[0],
                    prompt_length=len(request.token_ids))
            yield GenerateOutput(token_ids=new, finished=out.finished, finish_reason=completion.finish_reason,
                                 prompt_tokens=len(request.token_ids), disaggregated_params=handoff)

    async def encode(self, pixels: Any) -> EncodedMedia:
        raise NotImplementedError("TensorRT-LLM encode workers take image URLs through MultimodalEncoder")

    def take_handoff(self, handle: str) -> tuple[dict, bytes]:
        raise RuntimeError("with TensorRT-LLM the cache transceiver moves the KV cache, not hpc")

    def stats(self) -> dict[str, float]:
        return dict(self._counters)
