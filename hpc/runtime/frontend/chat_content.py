"""How an image in a chat message reaches the model's chat template, as TensorRT-LLM's own chat path does it.

A vision model's processor expands its own placeholder into the image's tokens: `<image>` for LLaVA-NeXT,
`<|vision_start|><|image_pad|><|vision_end|>` for the Qwen VL models. A prompt with any other marker reaches the
processor with no place for the image. Two kinds of chat template (tensorrt_llm/inputs/content_format.py):
- OPENAI: the template loops over `message['content']` and tests each part's `type`; it writes the placeholder
  itself, so the message keeps its parts: {"type": "text", "text": ...} and {"type": "image"}
  (tensorrt_llm/inputs/utils.py, _build_openai_content).
- STRING: the template prints `message['content']` as text, or the model registered this form whatever its
  template (utils.py, _resolve_content_format); the placeholder the model registered goes where the image was,
  joined to the text by the model's separator (utils.py, interleave_mm_placeholders; the placeholders in
  hpc/runtime/engine/placeholders.py).
"""

from __future__ import annotations

from typing import Any, Literal

import jinja2
from jinja2 import nodes

from hpc.runtime.engine.placeholders import ImagePlaceholder

ContentFormat = Literal["openai", "string"]


def _iterates_content(source: nodes.Node) -> bool:
    """`message['content']` or `message.content`, perhaps through filters (`| selectattr('type', ...)`)."""
    while isinstance(source, nodes.Filter) and source.node is not None:
        source = source.node
    return (isinstance(source, nodes.Getitem) and isinstance(source.arg, nodes.Const)
            and source.arg.value == "content") or (isinstance(source, nodes.Getattr) and source.attr == "content")


def _filters_on_type(source: nodes.Node) -> bool:
    while isinstance(source, nodes.Filter):
        if source.name in ("selectattr", "rejectattr") and source.args and \
                isinstance(source.args[0], nodes.Const) and source.args[0].value == "type":
            return True
        source = source.node
    return False


def content_format(template: str) -> ContentFormat:
    """OPENAI when some loop over a message's content reads its items' `type` (['type'], .type, or a
    selectattr('type', ...) on the loop's source); STRING otherwise, or when the template does not parse."""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(nodes.For):
        if not _iterates_content(loop.iter) or not isinstance(loop.target, nodes.Name):
            continue
        if _filters_on_type(loop.iter):
            return "openai"
        for read in loop.find_all((nodes.Getitem, nodes.Getattr)):
            on_item = isinstance(read.node, nodes.Name) and read.node.name == loop.target.name
            key = read.arg.value if isinstance(read, nodes.Getitem) and isinstance(read.arg, nodes.Const) \
                else getattr(read, "attr", None)
            if on_item and key == "type":
                return "openai"
    return "string"


class ImagePartError(ValueError):
    """A message with an image that this model's template and placeholder cannot carry."""


def message_content(content: str | list[dict[str, Any]], fmt: ContentFormat,
                    placeholder: ImagePlaceholder | None) -> str | list[dict[str, Any]]:
    """What a template gets as a message's content, sent as text or as parts (text and image_url, checked).
    A template of the OPENAI kind gets parts for every message with text, as vLLM gives it: such templates index
    `message['content']` without asking whether it is a string."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if fmt == "openai":
        if not content:
            return ""
        return [{"type": "image"} if part.get("type") == "image_url"
                else {"type": "text", "text": str(part.get("text", ""))} for part in parts]
    has_image = any(part.get("type") == "image_url" for part in parts)
    if not has_image:
        return "".join(str(part.get("text", "")) for part in parts)
    if placeholder is None:
        raise ImagePartError("this model's chat template does not take image parts, and hpc does not know the "
                             "image placeholder of its model_type")
    return placeholder.separator.join(placeholder.text if part.get("type") == "image_url"
                                      else str(part.get("text", "")) for part in parts)
