"""Tool calls and reasoning end to end: a canned answer with R1/Qwen3-style <think> and hermes <tool_call> markup
comes out of the tiny model through the real sampler, and the official client sees reasoning_content and
tool_calls, streamed and not."""

from __future__ import annotations

import json

import pytest

from tests.runtime.conftest import stack_fixture

openai = pytest.importorskip("openai", reason="the dev extra installs the official client")

pytestmark = pytest.mark.integration

CANNED = ('<think>The user wants the weather.</think>Let me check.<tool_call>{"name": "get_weather", '
          '"arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>')
tools_stack = stack_fixture("tiny-agg", "--set", f"model.canned_completion={json.dumps(CANNED)}",
                            "--set", "model.reasoning_parser=qwen3", "--set", "model.tool_call_parser=hermes")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_call_and_reasoning_whole_and_streamed(tools_stack):
    c = openai.OpenAI(base_url=tools_stack.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model=tools_stack.model, messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}

    content, reasoning, calls, reasons = "", "", [], []
    for chunk in c.chat.completions.create(model=tools_stack.model, messages=ASK, tools=TOOLS, max_tokens=200,
                                           stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            calls += ch.delta.tool_calls or []
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert (content, reasoning, reasons) == ("Let me check.", "The user wants the weather.", ["tool_calls"])
    assert [(t.index, t.function.name, json.loads(t.function.arguments)["city"]) for t in calls] == \
        [(0, "get_weather", "Paris")]


def test_tools_reach_the_template_and_the_conversation_goes_on(tools_stack):
    c = openai.OpenAI(base_url=tools_stack.url + "/v1", api_key="none", max_retries=0)
    plain = c.chat.completions.create(model=tools_stack.model, messages=ASK, max_tokens=200)
    assert plain.choices[0].message.tool_calls is None  # no tools offered: the markup stays text
    assert "<tool_call>" in plain.choices[0].message.content
    with_tools = c.chat.completions.create(model=tools_stack.model, messages=ASK, tools=TOOLS, max_tokens=5)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the tools were rendered
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    follow = c.chat.completions.create(
        model=tools_stack.model, tools=TOOLS, max_tokens=5,
        messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}])
    assert follow.usage.prompt_tokens > with_tools.usage.prompt_tokens  # the call and its answer are in the prompt
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=tools_stack.model, messages=ASK, tools=TOOLS, tool_choice="required")
    assert refused.value.body["param"] == "tool_choice"
