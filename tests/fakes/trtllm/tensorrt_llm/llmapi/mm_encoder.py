"""Upstream: tensorrt_llm/llmapi/mm_encoder.py (MultimodalEncoder, a _TorchLLM subclass).

Modelled: generate_async(inputs, sampling_params=None) on a multimodal prompt returns a result whose
`disaggregated_params.multimodal_embedding_handles` is a list of dicts with a "tensor_size" (the shape the
OpenAI server checks in serve/openai_server.py, openai_mm_encoder) — one per image; a prompt without an image
is refused, and so is one without the model's image placeholder (the request goes through BaseLLM.generate_async,
whose input processor runs the model's processor on the text). The handles here carry a digest of the image
instead of a CUDA IPC handle.
"""

from __future__ import annotations

from typing import Any, Optional

from tensorrt_llm.disaggregated_params import DisaggregatedParams
from tensorrt_llm.llmapi.llm import (MROPE_MODEL_TYPES, BaseLLM, _log, check_image_placeholders, image_digest,
                                     prompt_digest, tokenize)


class MultimodalEncoder(BaseLLM):
    def __init__(self, model: str, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 dtype: str = "auto", **kwargs: Any) -> None:
        kwargs.setdefault("max_num_tokens", 16384)
        super().__init__(model, trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size,
                         dtype=dtype, **kwargs)

    def generate_async(self, inputs: Any, sampling_params: Optional[Any] = None):
        if not isinstance(inputs, dict) or not (inputs.get("multi_modal_data") or {}).get("image"):
            raise ValueError("MultimodalEncoder needs a prompt with multi_modal_data['image']")
        images = inputs["multi_modal_data"]["image"]
        check_image_placeholders(self._config, str(inputs.get("prompt", "")), len(images))
        hidden = int(self._config.get("hidden_size", 64))
        handles = [{"tensor_size": [16, hidden], "dtype": "bfloat16", "fake_digest": image_digest(img)}
                   for img in images]
        result = super().generate_async({"prompt_token_ids": [1]}, sampling_params)
        mrope = {}
        if self._config.get("model_type") in MROPE_MODEL_TYPES:
            # the positions span the whole prompt as the input processor tokenized it, text and image grid: they
            # hold for that token sequence only
            ids = tokenize(self._tokenizer, str(inputs.get("prompt", "")),
                           sampling_params.add_special_tokens if sampling_params is not None else True)
            mrope = {"mrope_position_ids_handle": {"tensor_size": [3, 1, len(ids)], "fake_prompt": prompt_digest(ids)},
                     "mrope_position_deltas_handle": {"tensor_size": [1, 1]}}
        result.disaggregated_params = DisaggregatedParams(multimodal_embedding_handles=handles, **mrope)
        result.mm_embedding_handle = handles[0]
        _log("encode", images=len(images))
        return result
