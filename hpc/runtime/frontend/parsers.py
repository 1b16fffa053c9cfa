"""Reasoning and tool-call parsers: the model's markup -> OpenAI's `reasoning_content` and `tool_calls`.

Both work incrementally on the text deltas the frontend already produces, so streamed and whole answers split
the same way. Text that may be the start of a tag is held back until it cannot be (as stop strings are).
Chosen per recipe: `model.reasoning_parser`, `model.tool_call_parser`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag` (kept back until the next delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Split:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ThinkTags:
    """DeepSeek-R1 and Qwen3: reasoning between <think> and </think>, the answer after it. R1's chat template
    opens the <think> itself, so the output may begin inside the reasoning with no opening tag."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.inside = starts_in_reasoning
        self.decided = starts_in_reasoning  # past the point where a leading <think> could still come
        self.after_close = False  # the newlines that follow </think> are not part of the answer
        self.buffer = ""

    def feed(self, delta: str, final: bool = False) -> Split:
        self.buffer += delta
        out = Split()
        while self.buffer:
            if not self.inside:
                if not self.decided:
                    lead = self.buffer.lstrip()
                    if lead.startswith(self.OPEN):
                        self.buffer, self.inside, self.decided = lead[len(self.OPEN):], True, True
                        continue
                    if self.OPEN.startswith(lead) and not final:
                        break  # may still become <think>
                    self.decided = True
                if self.after_close:
                    self.buffer = self.buffer.lstrip("\n")
                    self.after_close = not self.buffer
                out.content += self.buffer
                self.buffer = ""
                break
            at = self.buffer.find(self.CLOSE)
            if at >= 0:
                out.reasoning += self.buffer[:at]
                self.buffer, self.inside, self.after_close = self.buffer[at + len(self.CLOSE):], False, True
                continue
            keep = 0 if final else _held(self.buffer, self.CLOSE)
            out.reasoning += self.buffer[:len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return out


class HermesToolCalls:
    """Hermes / Qwen3 style: each call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>. A call is
    sent whole once its closing tag arrived (OpenAI clients accept the arguments in one delta)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""
        self.count = 0

    def feed(self, delta: str, final: bool = False) -> Split:
        self.buffer += delta
        out = Split()
        while self.buffer:
            at = self.buffer.find(self.OPEN)
            if at < 0:
                keep = 0 if final else _held(self.buffer, self.OPEN)
                out.content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out.content += self.buffer[:at]
            end = self.buffer.find(self.CLOSE, at)
            if end < 0:
                if final:  # an unterminated call is text, not a call
                    out.content += self.buffer[at:]
                    self.buffer = ""
                else:
                    self.buffer = self.buffer[at:]
                break
            call = self._call(self.buffer[at + len(self.OPEN):end])
            if call is None:
                out.content += self.buffer[at:end + len(self.CLOSE)]
            else:
                out.tool_calls.append(call)
            self.buffer = self.buffer[end + len(self.CLOSE):]
        return out

    def _call(self, body: str) -> dict[str, Any] | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        call = {"index": self.count, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": data["name"],
                             "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
        self.count += 1
        return call


class Llama3JsonToolCalls(HermesToolCalls):
    """Llama 3.x: the whole answer is one JSON object {"name": ..., "parameters": {...}} (optionally after
    <|python_tag|>); anything else is plain content."""

    def feed(self, delta: str, final: bool = False) -> Split:
        self.buffer += delta
        if not final:
            return Split()  # the answer is a call only if all of it parses: decided at the end
        text, self.buffer = self.buffer, ""
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = self._call(body) if body.startswith("{") else None
        return Split(tool_calls=[call]) if call else Split(content=text)


REASONING_PARSERS = {"deepseek_r1": lambda: ThinkTags(starts_in_reasoning=True),
                     "qwen3": lambda: ThinkTags(starts_in_reasoning=False)}
TOOL_CALL_PARSERS = {"hermes": HermesToolCalls, "qwen3": HermesToolCalls, "llama3_json": Llama3JsonToolCalls}


class AnswerParser:
    """Reasoning first, then tool calls in what is left: one object per generated sample."""

    def __init__(self, reasoning: str | None, tools: str | None) -> None:
        self.reasoning = REASONING_PARSERS[reasoning]() if reasoning else None
        self.tools = TOOL_CALL_PARSERS[tools]() if tools else None

    def feed(self, delta: str, final: bool = False) -> Split:
        split = self.reasoning.feed(delta, final) if self.reasoning else Split(content=delta)
        if self.tools is not None:
            found = self.tools.feed(split.content, final)
            split.content, split.tool_calls = found.content, found.tool_calls
        return split
