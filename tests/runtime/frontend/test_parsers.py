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
    # DeepSeek-V3 / R1 tool calls: the list markers vanish, each call's JSON fence is its arguments
    ("deepseek_r1", "deepseek_v3", "Need two.</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
     "<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>"
     "function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Sure.", "Need two.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    # gpt-oss harmony: analysis is reasoning, a message to functions.X is a call, the final channel is content
    ("gpt_oss", "harmony", "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>", "",
     "User wants weather.", [("get_weather", {"city": "Oslo"})]),
    ("gpt_oss", None, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
     "It is 4.<|return|>", "It is 4.", "Easy.", []),
    ("gpt_oss", None, "plain text, no markup", "plain text, no markup", "", []),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("reasoning, tools, text, content, thought, calls", CASES)
def test_split_is_the_same_however_the_text_arrives(reasoning, tools, text, content, thought, calls, step):
    got_content, got_thought, got_calls = _run(text, reasoning, tools, step)
    assert (got_content, got_thought) == (content, thought)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert [c["index"] for c in got_calls] == list(range(len(calls)))
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)


@pytest.mark.parametrize("reasoning, tools", [(None, "hermes"), ("qwen3", "qwen3"), (None, "llama3_json"),
                                              ("deepseek_r1", "deepseek_v3"), ("gpt_oss", "harmony")])
def test_a_forced_call_guide_only_lets_through_calls_its_parser_reads(reasoning, tools):
    """Random walks through the tool_choice=required guide (any allowed character, closing within the budget,
    as the engine does) always read back as exactly one call to an offered tool with object arguments."""
    import random

    from hpc.runtime.engine.guided import Automaton
    from hpc.runtime.frontend.parsers import tool_call_guide
    from hpc.runtime.serve.wire import Guide

    names = ["get_weather", "get_time"]
    automaton = Automaton.from_guide(Guide(pieces=tool_call_guide(reasoning, tools, names)))
    alphabet = sorted(set('{}[]",:0123456789-.etrufalsn xy\n') | set("".join(
        v for p in tool_call_guide(reasoning, tools, names) for v in p.values)))
    rng = random.Random(0)
    for _ in range(60):
        state, text, budget = automaton.initial, "", rng.randint(automaton.min_close(automaton.initial), 150)
        for left in range(budget, 0, -1):
            if automaton.complete(state):
                break
            options = [c for c in alphabet if (n := automaton.step(state, c)) is not None
                       and automaton.min_close(n) <= left - 1]
            ch = rng.choice(options)
            state, text = automaton.step(state, ch), text + ch
        assert automaton.complete(state), text
        _, _, calls = _run(text, reasoning, tools, 3)
        assert len(calls) == 1, text
        assert calls[0]["function"]["name"] in names
        assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)


def test_a_json_answer_guide_reads_back_as_a_json_object_in_content():
    from hpc.runtime.engine.guided import Automaton
    from hpc.runtime.frontend.parsers import json_answer_guide
    from hpc.runtime.serve.wire import Guide

    for reasoning, text in ((None, '{"a": [1, 2]}'), ("deepseek_r1", 'ok</think>{"a": 1}'),
                            ("gpt_oss", '<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final'
                                        '<|message|>{"a": 1}')):
        automaton = Automaton.from_guide(Guide(pieces=json_answer_guide(reasoning)))
        state = automaton.feed(automaton.initial, text)
        assert state is not None and automaton.complete(state), (reasoning, text)
        content, _, _ = _run(text, reasoning, None, 2)
        assert isinstance(json.loads(content), dict)
    assert Automaton.from_guide(Guide(pieces=json_answer_guide(None))).feed((0, (0, "", None)), "[1]") is None
