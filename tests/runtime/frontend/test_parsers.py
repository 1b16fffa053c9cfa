"""Reasoning and tool-call parsers, fed whole and one character at a time: the same split either way."""

from __future__ import annotations

import json

import pytest

from hpc.runtime.frontend.parsers import AnswerParser

pytestmark = pytest.mark.unit


def _run(text: str, reasoning: str | None, tools: str | None, step: int) -> tuple[str, str, list[dict]]:
    parser = AnswerParser(reasoning, tools)
    content, thought, calls = "", "", []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        split = parser.feed(piece, final=i == len(pieces) - 1)
        content, thought, calls = content + split.content, thought + split.reasoning, calls + split.tool_calls
    return content, thought, calls


CASES = [
    # DeepSeek-R1: the template opened <think>, the output starts inside the reasoning
    ("deepseek_r1", None, "Let me think.\nIt is 4.</think>\n\nThe answer is 4.", "The answer is 4.",
     "Let me think.\nIt is 4.", []),
    # Qwen3: an explicit <think> block, then the answer
    ("qwen3", None, "<think>hmm < not a tag</think>Paris.", "Paris.", "hmm < not a tag", []),
    ("qwen3", None, "No thinking here: <think> later is text.", "No thinking here: <think> later is text.", "", []),
    ("qwen3", "hermes", '<think>need weather</think>Checking.<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Paris"}}</tool_call>', "Checking.", "need weather",
     [("get_weather", {"city": "Paris"})]),
    (None, "hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
     '"arguments": {"x": 1}}</tool_call>', "", "", [("a", {}), ("b", {"x": 1})]),
    (None, "hermes", "<tool_call>not json</tool_call> and <tool_c", "<tool_call>not json</tool_call> and <tool_c",
     "", []),
    (None, "llama3_json", '{"name": "search", "parameters": {"q": "hpc"}}', "", "", [("search", {"q": "hpc"})]),
    (None, "llama3_json", "{ not a call", "{ not a call", "", []),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("reasoning, tools, text, content, thought, calls", CASES)
def test_split_is_the_same_however_the_text_arrives(reasoning, tools, text, content, thought, calls, step):
    got_content, got_thought, got_calls = _run(text, reasoning, tools, step)
    assert (got_content, got_thought) == (content, thought)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert [c["index"] for c in got_calls] == list(range(len(calls)))
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
