"""Where an image goes in a vision model's prompt: the placeholder its processor expands into the image's tokens.

By config.json's model_type, the placeholders TensorRT-LLM's input processors register (`register_input_processor`
in tensorrt_llm/_torch/models/modeling_llava_next.py, modeling_qwen2vl.py, modeling_qwen3vl.py; its
MultimodalPlaceholderMetadata joins placeholders and text with "\\n" unless a model says otherwise). hpc's tiny
vision model (`hpc_vision` in its config.json) has no processor: hpc writes its <|image|> once per embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImagePlaceholder:
    text: str
    separator: str = "\n"
    # a model that registers its content format overrides what its chat template's shape says ("string": the
    # placeholder goes into the text even where the template could take parts)
    content_format: str | None = None


# Qwen2-VL and Qwen2.5-VL register content_format=STRING (modeling_qwen2vl.py); Qwen3-VL leaves it to the template
QWEN_VL = ImagePlaceholder("<|vision_start|><|image_pad|><|vision_end|>", content_format="string")
IMAGE_PLACEHOLDERS: dict[str, ImagePlaceholder] = {
    "llava_next": ImagePlaceholder("<image>"),
    "qwen2_vl": QWEN_VL,
    "qwen2_5_vl": QWEN_VL,
    "qwen3_vl": ImagePlaceholder(QWEN_VL.text),  # modeling_qwen3vl.py
    "qwen3_vl_moe": ImagePlaceholder(QWEN_VL.text),  # modeling_qwen3vl_moe.py
}
TINY_IMAGE = ImagePlaceholder("<|image|>", separator="")


def image_placeholder(model_config: dict[str, Any]) -> ImagePlaceholder | None:
    """The model's placeholder, or None for a model_type hpc does not know."""
    if model_config.get("hpc_vision"):
        return TINY_IMAGE
    return IMAGE_PLACEHOLDERS.get(str(model_config.get("model_type", "")))


def encoder_prompt(model_config: dict[str, Any]) -> str:
    """The text beside one image sent to TensorRT-LLM's MultimodalEncoder: its input processor runs the model's
    processor on it, which looks for the model's own placeholder (the tiny model's, once per embedding)."""
    vision = model_config.get("hpc_vision")
    if vision:
        return TINY_IMAGE.text * int(vision["num_image_tokens"])
    found = image_placeholder(model_config)
    return found.text if found else "<image>"
