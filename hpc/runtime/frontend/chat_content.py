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
  hpc/model/placeholders.py).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Callable, Literal

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hpc.model.placeholders import ImagePlaceholder

ContentFormat = Literal["openai", "string"]


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """The environment checkpoints' chat templates are written for: transformers' (utils/chat_template_utils.py,
    _compile_jinja_template). A missing key is falsy, not an error (`{% if message.tool_calls %}` on a message
    without calls); {% break %} and {% continue %}; raise_exception() and strftime_now(); tojson that keeps
    non-ASCII and does not HTML-escape < > & (Jinja's own does)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _iterates_content(source: nodes.Node) -> bool:
    """`message['content']` or `message.content`, perhaps through filters (`| selectattr('type', ...)`)."""
    while isinstance(source, nodes.Filter) and source.node is not None:
        source = source.node
    return (isinstance(source, nodes.Getitem) and isinstance(source.arg, nodes.Const)
            and source.arg.value == "content") or (isinstance(source, nodes.Getattr) and source.attr == "content")


def _filters_on_type(source: nodes.Node | None) -> bool:
    while isinstance(source, nodes.Filter):
        if source.name in ("selectattr", "rejectattr") and source.args and \
                isinstance(source.args[0], nodes.Const) and source.args[0].value == "type":
            return True
        source = source.node
    return False


def content_format(template: str) -> ContentFormat:
    """OPENAI when some loop over a message's content reads its items' `type` (['type'], .type, or a
    selectattr('type', ...) on the loop's source); STRING otherwise, or when the template does not parse."""
    try:  # in the environment it renders in: a plain one refuses {% break %}, and the template with it
        ast = chat_template_environment().parse(template)
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


def resolved_format(template: str | None, placeholder: ImagePlaceholder | None) -> ContentFormat:
    """The form a model registered first, else its template's shape (tensorrt_llm/inputs/utils.py,
    _resolve_content_format); no template: text."""
    registered = placeholder.content_format if placeholder else None
    if registered in ("openai", "string"):
        return registered
    return content_format(template) if template else "string"


class ChatInputError(ValueError):
    """A chat request this model's template cannot take as it is: a 400 naming the parameter."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def template_messages(messages: list[Any], content: Callable[[Any], Any], multimodal: bool
                      ) -> tuple[list[dict[str, Any]], list[str]]:
    """The request's messages as the template gets them (`content`: the codec's message_content), and the
    images' URLs in order."""
    out, images = [], []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            where = f"messages.{i}.content.{j}"
            if part.get("type") == "image_url":
                if not multimodal:
                    raise ChatInputError(where, "this model takes no images")
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
            elif part.get("type") != "text":
                raise ChatInputError(f"{where}.type", f"unsupported content part type {str(part.get('type'))[:40]!r}"
                                                      " (text, or image_url on a multimodal model)")
            elif not isinstance(part.get("text"), str):
                raise ChatInputError(f"{where}.text", "a text part's text must be a string")
        message: dict[str, Any] = {"role": m.role, "content": content(m.content or "")}
        # only what is there: templates test `is defined`
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    return out, images


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
        raise ChatInputError("messages", "this model's chat template does not take image parts, and hpc does not "
                                         "know the image placeholder of its model_type")
    return placeholder.separator.join(placeholder.text if part.get("type") == "image_url"
                                      else str(part.get("text", "")) for part in parts)


# set by the frontend itself; a request's chat_template_kwargs may not replace them
RENDER_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def template_kwargs(chat_template_kwargs: dict[str, Any] | None, reasoning_effort: str | None,
                    template_reads: frozenset[str]) -> dict[str, Any]:
    """A request's variables for the chat template: chat_template_kwargs as given (vLLM's and trtllm-serve's
    extension), and reasoning_effort for a template that reads it (gpt-oss's). A reasoning_effort the template
    would ignore is refused: the client would believe it had asked for something."""
    found = dict(chat_template_kwargs or {})
    own = sorted(RENDER_OWN & found.keys())
    if own:
        raise ChatInputError("chat_template_kwargs",
                             f"chat_template_kwargs may not set {', '.join(own)}: the server renders those itself")
    if reasoning_effort is not None:
        if "reasoning_effort" not in template_reads:
            raise ChatInputError("reasoning_effort", "'reasoning_effort' is not supported by this model's chat "
                                 "template (the recipe's model decides how much it reasons)",
                                 code="unsupported_parameter")
        found.setdefault("reasoning_effort", reasoning_effort)
    return found

