"""Tool calls and reasoning end to end: a canned answer with R1/Qwen3-style <think> and hermes <tool_call> markup
comes out of the tiny model through the real sampler, and the official client sees reasoning_content and
tool_calls, streamed and not."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

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
        c.chat.completions.create(model=tools_stack.model, messages=ASK, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "not_offered"}})
    assert refused.value.body["param"] == "tool_choice" and "not among the tools" in refused.value.body["message"]


# No canned answer: the random-weight model itself, held to the hermes format by constrained decoding.
guided_stack = stack_fixture("tiny-agg", "--set", "model.tool_call_parser=hermes")
TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_a_forced_tool_call_comes_out_of_a_random_model_whole_and_streamed(guided_stack):
    c = openai.OpenAI(base_url=guided_stack.url + "/v1", api_key="none", max_retries=0)
    free = c.chat.completions.create(model=guided_stack.model, messages=ASK, tools=TWO_TOOLS, max_tokens=30, seed=1)
    assert free.choices[0].message.tool_calls is None  # left alone, the random model calls nothing
    for choice_param, names in (("required", {"get_weather", "get_time"}),
                                ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        r = c.chat.completions.create(model=guided_stack.model, messages=ASK, tools=TWO_TOOLS, max_tokens=80,
                                      tool_choice=choice_param, seed=1)
        choice = r.choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name in names
        assert isinstance(json.loads(call.function.arguments), dict)
    calls, reasons = [], []
    for chunk in c.chat.completions.create(model=guided_stack.model, messages=ASK, tools=TWO_TOOLS, max_tokens=80,
                                           tool_choice="required", stream=True, temperature=0.7):
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert reasons == ["tool_calls"] and len(calls) == 1 and calls[0].function.name in {"get_weather", "get_time"}
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_response_format_json_object_gives_a_json_object(guided_stack):
    import asyncio

    c = openai.OpenAI(base_url=guided_stack.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model=guided_stack.model, messages=ASK, max_tokens=40,
                                  response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"

    async def streamed() -> str:
        a = openai.AsyncOpenAI(base_url=guided_stack.url + "/v1", api_key="none", max_retries=0)
        text = ""
        async for chunk in await a.chat.completions.create(model=guided_stack.model, messages=ASK, max_tokens=40,
                                                           response_format={"type": "json_object"}, stream=True):
            text += "".join(ch.delta.content or "" for ch in chunk.choices)
        await a.close()
        return text
    assert isinstance(json.loads(asyncio.run(streamed())), dict)
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=guided_stack.model, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert refused.value.body["param"] == "response_format"


# gpt-oss's harmony format end to end: the analysis channel is reasoning, a commentary message to functions.X is
# a call (the frontend keeps the markers, which are special tokens in gpt-oss's own vocabulary, in the text).
HARMONY = ("<|channel|>analysis<|message|>Weather needs a lookup.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')
harmony_stack = stack_fixture("tiny-agg", "--set", f"model.canned_completion={json.dumps(HARMONY)}",
                              "--set", "model.reasoning_parser=gpt_oss", "--set", "model.tool_call_parser=harmony")


def test_harmony_reasoning_and_tool_call_whole_and_streamed(harmony_stack):
    c = openai.OpenAI(base_url=harmony_stack.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model=harmony_stack.model, messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "Weather needs a lookup."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    reasoning, calls = "", []
    for chunk in c.chat.completions.create(model=harmony_stack.model, messages=ASK, tools=TOOLS, max_tokens=200,
                                           stream=True):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            calls += ch.delta.tool_calls or []
    assert reasoning == "Weather needs a lookup." and [t.function.name for t in calls] == ["get_weather"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("fields, param, says", [
    ({"tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters", "JSON Schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"properties": ["city"]}}}]},
     "tools.0.function.parameters", "properties must map"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"required": "city"}}}]},
     "tools.0.function.parameters", "required must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "$(id)"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{**WEATHER, "extra": 1}]}, "tools.0.extra", "Extra inputs"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "only allowed when tools are given"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", ""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among the tools offered"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", ""),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "boolean"),
    ({"stream": True, "stream_options": {"include_usge": True}}, "stream_options.include_usge", "Extra inputs"),
    ({"stream": True, "stream_options": ["include_usage"]}, "stream_options", ""),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'system'"),
    ({"messages": [{"role": None, "content": "hi"}]}, "messages.0.role", ""),
    ({"stop": ["x"] * 33}, "stop", "at most 32"),
    ({"stop": [""]}, "stop", "1 to 4096 characters"),
    ({"stop": "s" * 5000}, "stop", "1 to 4096 characters"),
])
def test_a_request_whose_tools_stream_options_roles_or_stops_are_not_openais_is_a_400_naming_the_field(
        guided_stack, fields, param, says):
    body = {"model": guided_stack.model, "messages": ASK, "max_tokens": 2, **fields}
    request = urllib.request.Request(guided_stack.url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    answer = json.loads(refused.value.read())["error"]
    assert refused.value.code == 400 and answer["param"].startswith(param), answer
    assert says in answer["message"] and len(answer["message"]) < 600, answer
    ok = {"model": guided_stack.model, "messages": ASK, "max_tokens": 2, "tools": [WEATHER], "tool_choice": "auto",
          "stream": True, "stream_options": {"include_usage": True}}
    with urllib.request.urlopen(urllib.request.Request(guided_stack.url + "/v1/chat/completions",
                                                       json.dumps(ok).encode(),
                                                       {"Content-Type": "application/json"}), timeout=30) as served:
        assert served.status == 200 and b'"usage"' in served.read()  # the well-formed one is served on
