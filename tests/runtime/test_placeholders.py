"""The text beside an image sent to TensorRT-LLM's MultimodalEncoder names the image as the model's processor
expects it (a Qwen VL processor finds nothing to expand in LLaVA's <image>)."""

from __future__ import annotations

import pytest

from hpc.model.placeholders import encoder_prompt, image_placeholder

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("config, prompt", [
    ({"model_type": "qwen2_vl"}, "<|vision_start|><|image_pad|><|vision_end|>"),
    ({"model_type": "qwen2_5_vl"}, "<|vision_start|><|image_pad|><|vision_end|>"),
    ({"model_type": "qwen3_vl_moe"}, "<|vision_start|><|image_pad|><|vision_end|>"),
    ({"model_type": "llava_next"}, "<image>"),
    ({"model_type": "llama", "hpc_vision": {"num_image_tokens": 3}}, "<|image|><|image|><|image|>"),
    ({"model_type": "mystery_vl"}, "<image>"),  # TensorRT-LLM's most common marker, for a model hpc does not know
])
def test_the_encoders_prompt_is_the_models_own_placeholder(config, prompt):
    assert encoder_prompt(config) == prompt


def test_an_unknown_model_type_has_no_placeholder_for_a_text_template():
    assert image_placeholder({"model_type": "mystery_vl"}) is None
    assert image_placeholder({"model_type": "llava_next"}).separator == "\n"
