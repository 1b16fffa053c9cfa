"""Reasoning and tool-call parsers: the model's markup -> OpenAI's `reasoning_content` and `tool_calls`.

Both work incrementally on the text deltas the frontend already produces, so streamed and whole answers split
the same way. Text that may be the start of a tag is held back until it cannot be (as stop strings are).
Chosen per recipe: `model.reasoning_parser`, `model.tool_call_parser`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hpc.runtime.serve.wire import GuidePiece


def _text(value: str) -> GuidePiece:
    return GuidePiece(kind="text", values=[value])


def _choice(values: list[str]) -> GuidePiece:
    return GuidePiece(kind="choice", values=values)


def _until(tag: str) -> GuidePiece:
    return GuidePiece(kind="until", values=[tag])


JSON_OBJECT = GuidePiece(kind="json_object")


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
    DROP: tuple[str, ...] = ()  # markers around the calls that are neither content nor a call

    def __init__(self) -> None:
        self.buffer = ""
        self.count = 0

    @classmethod
    def forced(cls, names: list[str]) -> list[GuidePiece]:
        """A guide for exactly one call to one of `names` in this format (tool_choice required / named)."""
        return [_text('<tool_call>{"name": "'), _choice([f'{n}", "arguments": ' for n in names]), JSON_OBJECT,
                _text("}</tool_call>")]

    def feed(self, delta: str, final: bool = False) -> Split:
        self.buffer += delta
        for marker in self.DROP:
            self.buffer = self.buffer.replace(marker, "")
        out = Split()
        while self.buffer:
            at = self.buffer.find(self.OPEN)
            if at < 0:
                keep = 0 if final else max(_held(self.buffer, tag) for tag in (self.OPEN, *self.DROP))
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

    @classmethod
    def forced(cls, names: list[str]) -> list[GuidePiece]:
        return [_text('{"name": "'), _choice([f'{n}", "parameters": ' for n in names]), JSON_OBJECT, _text("}")]

    def feed(self, delta: str, final: bool = False) -> Split:
        self.buffer += delta
        if not final:
            return Split()  # the answer is a call only if all of it parses: decided at the end
        text, self.buffer = self.buffer, ""
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = self._call(body) if body.startswith("{") else None
        return Split(tool_calls=[call]) if call else Split(content=text)


class DeepSeekV3ToolCalls(HermesToolCalls):
    """DeepSeek-V3 / R1: <｜tool▁calls▁begin｜>, then per call <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    and the arguments in a ```json fence, <｜tool▁call▁end｜>; <｜tool▁calls▁end｜> closes the list."""

    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    OPEN, CLOSE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    DROP = (BEGIN, END)
    BODY = re.compile(r"\s*function<｜tool▁sep｜>(?P<name>[^\n]+)\n```json\n(?P<args>.*)\n```\s*$", re.DOTALL)

    @classmethod
    def forced(cls, names: list[str]) -> list[GuidePiece]:
        return [_text(f"{cls.BEGIN}{cls.OPEN}function{cls.SEP}"), _choice([f"{n}\n```json\n" for n in names]),
                JSON_OBJECT, _text(f"\n```{cls.CLOSE}{cls.END}")]

    def _call(self, body: str) -> dict[str, Any] | None:
        match = self.BODY.match(body)
        if not match:
            return None
        try:
            arguments = json.loads(match["args"])
        except ValueError:
            return None
        return super()._call(json.dumps({"name": match["name"].strip(), "arguments": arguments}))


class Harmony:
    """gpt-oss's harmony format, reasoning and tool calls together. Each message is
    `<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY`, ended by <|end|> (and the next
    opens with <|start|>assistant), <|call|> (a tool call) or <|return|> (the answer's end). The analysis
    channel is reasoning; a message to functions.NAME is a call with BODY as its arguments; the rest is content.
    Needs the markers in the text: the frontend keeps special tokens when a recipe uses this parser."""

    MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
    RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")

    def __init__(self) -> None:
        self.buffer = ""
        self.header = True
        self.channel, self.recipient, self.arguments = "", None, ""
        self.count = 0

    @classmethod
    def forced(cls, names: list[str]) -> list[GuidePiece]:
        return [_text("<|channel|>commentary to=functions."),
                _choice([f"{n} <|constrain|>json{cls.MESSAGE}" for n in names]), JSON_OBJECT, _text("<|call|>")]

    def feed(self, delta: str, final: bool = False) -> Split:
        self.buffer += delta
        out = Split()
        while self.buffer:
            if self.header:
                at = self.buffer.find(self.MESSAGE)
                if at < 0:
                    if final:  # no harmony markup at all: plain text
                        out.content += self.buffer
                        self.buffer = ""
                    break
                head, self.buffer = self.buffer[:at], self.buffer[at + len(self.MESSAGE):]
                channel = re.search(r"<\|channel\|>(\w+)", head)
                recipient = self.RECIPIENT.search(head)
                self.channel = channel.group(1) if channel else "final"
                self.recipient, self.arguments, self.header = recipient and recipient.group(1), "", False
                continue
            ends = [(self.buffer.find(m), m) for m in self.ENDS if m in self.buffer]
            if not ends:
                keep = 0 if final else max(_held(self.buffer, m) for m in self.ENDS)
                self._route(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                if final and self.recipient:
                    self._call(out)
                break
            at, marker = min(ends)
            self._route(self.buffer[:at], out)
            self.buffer = self.buffer[at + len(marker):].removeprefix("<|start|>assistant")
            if self.recipient:
                self._call(out)
            self.header = True
        return out

    def _route(self, text: str, out: Split) -> None:
        if self.recipient:
            self.arguments += text
        elif self.channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _call(self, out: Split) -> None:
        out.tool_calls.append({"index": self.count, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.recipient, "arguments": self.arguments.strip()}})
        self.count += 1
        self.recipient = None


# What a reasoning model writes before its answer: a forced tool call or JSON answer comes after it.
REASONING_PREAMBLES = {"deepseek_r1": [_until("</think>")], "qwen3": [_text("<think>"), _until("</think>")],
                       "gpt_oss": [_text("<|channel|>analysis<|message|>"), _until("<|end|>"),
                                   _text("<|start|>assistant")]}
HARMONY = ("gpt_oss", "harmony")  # the reasoning and tool-call parser names of the one harmony parser


def json_answer_guide(reasoning: str | None) -> list[GuidePiece]:
    """response_format json_object: the answer (after any reasoning) is one JSON object."""
    final = [_text("<|channel|>final<|message|>")] if reasoning == "gpt_oss" else []
    return [*REASONING_PREAMBLES.get(reasoning or "", []), *final, JSON_OBJECT]


def tool_call_guide(reasoning: str | None, tools: str, names: list[str]) -> list[GuidePiece]:
    """tool_choice required / a named function: after any reasoning, exactly one call in the recipe's format."""
    return [*REASONING_PREAMBLES.get(reasoning or "", []), *TOOL_CALL_PARSERS[tools].forced(names)]


REASONING_PARSERS = {"deepseek_r1": lambda: ThinkTags(starts_in_reasoning=True),
                     "qwen3": lambda: ThinkTags(starts_in_reasoning=False), "gpt_oss": Harmony}
TOOL_CALL_PARSERS = {"hermes": HermesToolCalls, "qwen3": HermesToolCalls, "llama3_json": Llama3JsonToolCalls,
                     "deepseek_v3": DeepSeekV3ToolCalls, "harmony": Harmony}


class AnswerParser:
    """Reasoning first, then tool calls in what is left: one object per generated sample."""

    def __init__(self, reasoning: str | None, tools: str | None) -> None:
        self.reasoning = REASONING_PARSERS[reasoning]() if reasoning else None
        self.tools = TOOL_CALL_PARSERS[tools]() if tools else None
        if reasoning in HARMONY or tools in HARMONY:  # one harmony parser splits all three
            self.reasoning, self.tools = Harmony(), None

    def feed(self, delta: str, final: bool = False) -> Split:
        split = self.reasoning.feed(delta, final) if self.reasoning else Split(content=delta)
        if self.tools is not None:
            found = self.tools.feed(split.content, final)
            split.content, split.tool_calls = found.content, found.tool_calls
        return split
