"""An image in a chat message reaches a vision model's template as that model needs it: as parts for a template
that loops over a message's content, else as the placeholder TensorRT-LLM's processor for its model_type expands.
The templates below are written in the shapes of the real checkpoints' (Qwen2-VL: parts tested with ['type'];
LLaVA-NeXT: selectattr('type', ...) over the content, content[0]['text'] for other roles)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpc.runtime.engine.models.tiny import CHAT_TEMPLATE
from hpc.model.placeholders import ImagePlaceholder
from hpc.runtime.frontend.chat_content import ChatInputError, content_format, message_content
from hpc.runtime.frontend.tokenizer import TextCodec

pytestmark = pytest.mark.unit

QWEN_VL_STYLE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAVA_NEXT_STYLE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
    "{% for item in message['content'] | selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}{{ item['text'] }}{% endfor %}"
    " [/INST]{% else %}{{ message['content'][0]['text'] }}\n{% endif %}{% endfor %}")
WITH_IMAGE = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x.png"}}]


@pytest.mark.parametrize("template, expected", [
    (QWEN_VL_STYLE, "openai"),
    (LLAVA_NEXT_STYLE, "openai"),
    ("{% for c in message.content %}{{ c.type }}{% endfor %}", "openai"),
    # read in the environment it renders in: {% break %} is no syntax error there
    ("{% for c in message.content %}{% if c.type == 'image' %}<i>{% break %}{% endif %}{% endfor %}", "openai"),
    (CHAT_TEMPLATE, "string"),  # loops over messages, prints the content as text
    ("{% for c in message['content'] %}{{ c }}{% endfor %}", "string"),  # a loop that never asks a part's type
    ("{% for x in %}", "string"),  # does not parse
])
def test_the_templates_kind(template, expected):
    assert content_format(template) == expected


def test_a_message_with_an_image_as_each_kind_of_template_takes_it():
    assert message_content(WITH_IMAGE, "openai", None) == [{"type": "text", "text": "What is this?"},
                                                           {"type": "image"}]
    assert message_content("hello", "openai", None) == [{"type": "text", "text": "hello"}]
    assert message_content(WITH_IMAGE, "string", ImagePlaceholder("<image>")) == "What is this?\n<image>"
    assert message_content(WITH_IMAGE, "string", ImagePlaceholder("<|image|>", "")) == "What is this?<|image|>"
    assert message_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "string", None) == "ab"
    with pytest.raises(ChatInputError, match="does not know the image placeholder"):
        message_content(WITH_IMAGE, "string", None)


def _checkpoint(tiny: str, tmp_path: Path, model_type: str, **template_files: str) -> Path:
    """The tiny tokenizer in a checkpoint laid out as a vision model's: config.json's model_type, the chat template
    where that checkpoint keeps it (tokenizer_config.json, chat_template.json or chat_template.jinja)."""
    out = tmp_path / model_type
    out.mkdir()
    shutil.copy(Path(tiny) / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((Path(tiny) / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if "tokenizer_config" in template_files:
        config["chat_template"] = json.loads(template_files["tokenizer_config"])
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if "json" in template_files:
        (out / "chat_template.json").write_text(json.dumps({"chat_template": template_files["json"]}))
    if "jinja" in template_files:
        (out / "chat_template.jinja").write_text(template_files["jinja"])
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


def _prompt(codec: TextCodec, *messages: tuple[str, object]) -> str:
    return codec.apply_chat_template([{"role": role, "content": codec.message_content(content)}
                                      for role, content in messages])


def test_a_qwen_vl_checkpoint_gets_its_own_placeholder_from_its_processors_template(tiny, tmp_path):
    codec = TextCodec(_checkpoint(tiny, tmp_path, "qwen3_vl", json=QWEN_VL_STYLE))
    assert codec.content_format == "openai"
    prompt = _prompt(codec, ("system", "Be brief."), ("user", WITH_IMAGE))
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                      "What is this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    assert "<|image|>" not in prompt


def test_qwen2_vl_gets_the_text_form_it_registered_whatever_its_template_could_take(tiny, tmp_path):
    """modeling_qwen2vl.py registers content_format=STRING for Qwen2-VL and Qwen2.5-VL: the placeholder goes into
    the text, joined by "\n", as TensorRT-LLM's own server renders these models' chats."""
    codec = TextCodec(_checkpoint(tiny, tmp_path, "qwen2_vl", json=QWEN_VL_STYLE))
    assert codec.content_format == "string"
    assert "<|im_start|>user\nWhat is this?\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>" in \
        _prompt(codec, ("user", WITH_IMAGE))


def test_a_llava_next_checkpoint_whose_template_reads_parts_for_every_role(tiny, tmp_path):
    codec = TextCodec(_checkpoint(tiny, tmp_path, "llava_next", jinja=LLAVA_NEXT_STYLE))
    prompt = _prompt(codec, ("user", WITH_IMAGE), ("assistant", "A cat."), ("user", "Which colour?"))
    assert prompt == "[INST] <image>\nWhat is this? [/INST]A cat.\n[INST] Which colour? [/INST]"


def test_a_text_template_gets_the_placeholder_the_model_type_registered(tiny, tmp_path):
    named = json.dumps([{"name": "tool_use", "template": "unused"}, {"name": "default", "template": CHAT_TEMPLATE}])
    codec = TextCodec(_checkpoint(tiny, tmp_path, "llava_next", tokenizer_config=named))
    assert codec.content_format == "string"
    assert "<|user|>What is this?\n<image><|end|>" in _prompt(codec, ("user", WITH_IMAGE))
    unknown = TextCodec(_checkpoint(tiny, tmp_path, "mystery_vl", tokenizer_config=json.dumps(CHAT_TEMPLATE)))
    with pytest.raises(ChatInputError):
        unknown.message_content(WITH_IMAGE)
    assert _prompt(unknown, ("user", "hi")).endswith("<|user|>hi<|end|><|assistant|>")  # text still works


def test_the_tiny_vision_model_keeps_its_own_marker(tiny_mm):
    codec = TextCodec(Path(tiny_mm))
    assert codec.content_format == "string" and codec.message_content(WITH_IMAGE) == "What is this?<|image|>"


# In the shape of Qwen3's and Llama 3.1's templates: a date from strftime_now, tools as JSON, an assistant turn
# asked for tool_calls it does not have, a loop left with break, an unsupported role refused by raise_exception.
CHECKPOINT_STYLE = (
    "{% set date = strftime_now('%Y') %}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('roles: system, user, "
    "assistant') }}{% endif %}"
    "<|{{ message.role }}|>{{ message.content }}{% if message.tool_calls %}<calls>{% endif %}"
    "{% if loop.index >= 9 %}{% break %}{% endif %}{% endfor %}|{{ date | length }}")


def test_checkpoint_templates_render_as_transformers_renders_them(tiny, tmp_path):
    codec = TextCodec(_checkpoint(tiny, tmp_path, "qwen3", tokenizer_config=json.dumps(CHECKPOINT_STYLE)))
    tools = [{"type": "function", "function": {"name": "café", "description": "<b> & co"}}]
    prompt = codec.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                       tools)
    assert prompt == ('<tools>[{"type": "function", "function": {"name": "café", "description": "<b> & co"}}]'
                      "</tools><|user|>hi<|assistant|>yo|4")
    with pytest.raises(Exception, match="roles: system, user, assistant"):
        codec.apply_chat_template([{"role": "narrator", "content": "once"}])


def test_special_tokens_given_as_added_token_dicts_are_their_text(tiny, tmp_path):
    out = _checkpoint(tiny, tmp_path, "llama", tokenizer_config=json.dumps("{{ bos_token }}{{ messages[0].content }}"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["bos_token"] = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False}
    config["eos_token"] = {"__type": "AddedToken", "content": "<|end_of_text|>", "lstrip": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    codec = TextCodec(out)
    assert codec.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|begin_of_text|>hi"
    assert codec.eos_token_id == codec.tok.token_to_id("<|end_of_text|>")


# In the shapes of Qwen3's (enable_thinking) and gpt-oss's (reasoning_effort) templates
THINKING_STYLE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}")


def test_a_requests_template_kwargs_and_reasoning_effort_reach_the_template(tiny, tmp_path):
    from hpc.runtime.frontend.chat_content import template_kwargs

    codec = TextCodec(_checkpoint(tiny, tmp_path, "qwen3", tokenizer_config=json.dumps(THINKING_STYLE)))
    assert {"enable_thinking", "reasoning_effort", "messages"} <= codec.template_variables
    hi = [{"role": "user", "content": "hi"}]
    variables = template_kwargs({"enable_thinking": False}, "low", codec.template_variables)
    assert codec.apply_chat_template(hi, None, variables) == "<|user|>hi<|assistant|><think></think>Reasoning: low"
    assert codec.apply_chat_template(hi) == "<|user|>hi<|assistant|>"
    with pytest.raises(ChatInputError, match="may not set add_generation_prompt, messages") as caught:
        template_kwargs({"messages": [], "add_generation_prompt": False}, None, codec.template_variables)
    assert caught.value.param == "chat_template_kwargs"
    plain = TextCodec(Path(tiny))  # its template reads no reasoning_effort: asking for one is refused, not ignored
    with pytest.raises(ChatInputError, match="'reasoning_effort' is not supported") as caught:
        template_kwargs(None, "high", plain.template_variables)
    assert caught.value.param == "reasoning_effort"
    assert template_kwargs({"enable_thinking": True}, None, plain.template_variables) == {"enable_thinking": True}
